//! The text thread: between the caller and the engine thread, it turns requests into token ids (chat
//! template, tokenizer, the prompt checks) and the engine thread's tokens back into text (incremental
//! decoding, stop strings, log-probabilities by name), so neither the caller's thread (a server's
//! event loop) nor the engine thread ever waits on text work.
//!
//! The requests alive on the caller's side are one table, [`Live`], shared with the handle: whoever
//! removes a request from it (this thread at its end, or the handle's watchdog at its deadline) is the
//! one that reports its end, so it is reported exactly once.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TrySendError};
use pdserve_api::openai::{TokenLogprob, Usage};
use pdserve_api::pd::PdHandle;
use pdserve_api::{Role, Stage};
use pdserve_model::{IncrementalDecoder, TextCodec};
use pdserve_scheduler::{FinishReason, Outcome};

use crate::core::{Command, Reply, Submission, Times};
use crate::handle::EngineInfo;
use crate::metrics::Metrics;
use crate::text::apply_stop;
use crate::{EngineError, Finish, Id, Input, Output, Timings};

/// Recent prefill requests remembered for aborts of their offers.
const RECENT_PREFILLS_MAX: usize = 4096;

/// What the handle asks of the text thread, in order.
#[derive(Debug)]
pub(crate) enum Job {
    /// Tokenize `input` into the submission's prompt, check it, and hand it to the engine thread.
    Submit { sub: Box<Submission>, input: Input },
    /// Passed on to the engine thread in order (an abort never overtakes its request's submission).
    Command(Command),
}

/// The caller's side of one request.
#[derive(Debug)]
pub(crate) struct Stream {
    pub request_id: String,
    detok: IncrementalDecoder,
    pending: String,
    stop: Vec<String>,
    /// A stop string was seen: the engine was told to abort, and the end is reported as `Stop`.
    stopped: bool,
    logprobs: bool,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub received: Instant,
    pub deadline: Instant,
    first_token_at: Option<Instant>,
    last_token: Option<Instant>,
}

impl Stream {
    pub(crate) fn new(request_id: String, stop: Vec<String>, logprobs: bool, deadline: Instant) -> Stream {
        Stream {
            request_id,
            detok: IncrementalDecoder::new(),
            pending: String::new(),
            stop,
            stopped: false,
            logprobs,
            prompt_tokens: 0,
            completion_tokens: 0,
            received: Instant::now(),
            deadline,
            first_token_at: None,
            last_token: None,
        }
    }

    pub(crate) fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            cached_tokens: 0,
        }
    }
}

/// Every request alive on the caller's side.
#[derive(Debug, Default)]
pub(crate) struct Live {
    pub streams: HashMap<u64, Stream>,
    pub by_request_id: HashMap<String, u64>,
    /// Prefill role: recent requests whose KV is (or was) offered, so an abort can end the offer.
    pub recent_prefills: VecDeque<(String, u64)>,
}

impl Live {
    pub(crate) fn insert(&mut self, id: u64, s: Stream) {
        self.by_request_id.insert(s.request_id.clone(), id);
        self.streams.insert(id, s);
    }

    /// Takes the request out; only the taker reports its end.
    pub(crate) fn remove(&mut self, id: u64) -> Option<Stream> {
        let s = self.streams.remove(&id)?;
        self.by_request_id.remove(&s.request_id);
        Some(s)
    }
}

pub(crate) fn lock(live: &Mutex<Live>) -> MutexGuard<'_, Live> {
    live.lock().unwrap_or_else(|e| e.into_inner())
}

/// The text thread. See the [module docs](self).
pub(crate) struct TextThread {
    pub jobs: Receiver<Job>,
    pub replies: Receiver<Reply>,
    pub commands: Sender<Command>,
    pub outputs: Sender<Output>,
    pub wake: Arc<dyn Fn() + Send + Sync>,
    pub live: Arc<Mutex<Live>>,
    pub codec: Arc<TextCodec>,
    pub info: EngineInfo,
    pub metrics: Metrics,
    pub out: Vec<Output>,
}

impl TextThread {
    /// Runs until the handle is dropped (its job channel closes), then drops the engine thread's
    /// command channel, which ends that thread too.
    pub(crate) fn run(mut self) {
        loop {
            crossbeam_channel::select! {
                recv(self.jobs) -> job => match job {
                    Ok(job) => self.job(job),
                    Err(_) => return,
                },
                recv(self.replies) -> reply => match reply {
                    Ok(reply) => self.reply(reply),
                    // The engine thread is gone; the handle's watchdog ends what is left.
                    Err(_) => self.replies = crossbeam_channel::never(),
                },
            }
            // Take what else is ready before waking the caller, a bounded amount.
            for _ in 0..256 {
                match self.replies.try_recv() {
                    Ok(reply) => self.reply(reply),
                    Err(_) => break,
                }
            }
            self.flush();
        }
    }

    fn flush(&mut self) {
        if self.out.is_empty() {
            return;
        }
        for o in self.out.drain(..) {
            // The handle drains this channel on every poll; one that stays full for seconds means
            // its caller is stuck, and dropping the output is the lesser evil (the watchdog ends
            // the request at its deadline, and the log names it).
            if let Err(e) = self.outputs.send_timeout(o, Duration::from_secs(5)) {
                eprintln!("engine: output dropped, the caller did not poll for 5 s: {:?}", e.into_inner());
            }
        }
        (self.wake)();
    }

    fn job(&mut self, job: Job) {
        match job {
            Job::Submit { mut sub, input } => {
                let id = sub.id;
                match self.prompt(&input, sub.remote.is_some()) {
                    Ok(tokens) => sub.tokens = tokens,
                    Err(e) => return self.reject(id, e),
                }
                match lock(&self.live).streams.get_mut(&id) {
                    Some(s) => s.prompt_tokens = sub.tokens.len(),
                    None => return, // aborted or past its deadline while it waited here
                }
                match self.commands.try_send(Command::Submit(sub)) {
                    Ok(()) => {}
                    Err(TrySendError::Full(_)) => {
                        let limit = self.commands.capacity().unwrap_or(0);
                        self.reject(id, EngineError::Busy { limit });
                    }
                    Err(TrySendError::Disconnected(_)) => self.reject(id, EngineError::Stopped),
                }
            }
            // A full queue loses the abort; the watchdog then ends the request at its deadline.
            Job::Command(c) => {
                let _ = self.commands.try_send(c);
            }
        }
    }

    /// The prompt's token ids, checked against the vocabulary and the context.
    fn prompt(&self, input: &Input, remote: bool) -> Result<Vec<u32>, EngineError> {
        let invalid = |e: pdserve_model::ModelError| EngineError::InvalidInput { problem: e.to_string() };
        let tokens = match input {
            Input::Chat(msgs) => {
                let text = self.codec.apply_chat_template(msgs, true).map_err(invalid)?;
                self.codec.encode(&text).map_err(invalid)?
            }
            Input::Text(t) => self.codec.encode(t).map_err(invalid)?,
            Input::Tokens(t) => match t.iter().find(|&&x| x as usize >= self.info.vocab_size) {
                Some(bad) => {
                    return Err(EngineError::InvalidInput {
                        problem: format!(
                            "token id {bad} is outside the vocabulary of {}",
                            self.info.vocab_size
                        ),
                    })
                }
                None => t.clone(),
            },
            Input::Remote(_) => Vec::new(),
        };
        if !remote {
            if tokens.is_empty() {
                return Err(EngineError::InvalidInput { problem: "the prompt is empty".into() });
            }
            if tokens.len() >= self.info.context_tokens {
                return Err(EngineError::ContextLengthExceeded {
                    prompt_tokens: tokens.len(),
                    context_tokens: self.info.context_tokens,
                });
            }
        }
        Ok(tokens)
    }

    fn reject(&mut self, id: u64, error: EngineError) {
        if lock(&self.live).remove(id).is_some() {
            if let Ok(c) = self.metrics.rejected.with(&[error.kind().as_str()]) {
                c.inc();
            }
            self.out.push(Output::Rejected { id: Id(id), error });
        }
    }

    fn reply(&mut self, r: Reply) {
        match r {
            Reply::Batch(replies) => {
                for r in replies {
                    self.reply(r);
                }
            }
            Reply::Admitted { id, prompt_tokens } => {
                if let Some(s) = lock(&self.live).streams.get_mut(&id) {
                    s.prompt_tokens = prompt_tokens;
                    self.out.push(Output::Admitted { id: Id(id) });
                }
            }
            Reply::Rejected { id, error } => {
                if lock(&self.live).remove(id).is_some() {
                    self.out.push(Output::Rejected { id: Id(id), error });
                }
            }
            Reply::Token { id, token, logprob, top, stop } => self.token(id, token, logprob, top, stop),
            Reply::Prefilled { id, key, times } => {
                let mut live = lock(&self.live);
                let Some(s) = live.remove(id) else {
                    drop(live);
                    let _ = self.commands.try_send(Command::AbortTransfer(id));
                    return;
                };
                if live.recent_prefills.len() >= RECENT_PREFILLS_MAX {
                    live.recent_prefills.pop_front();
                }
                live.recent_prefills.push_back((s.request_id.clone(), id));
                drop(live);
                let now = Instant::now();
                self.metrics.e2e.record(now.saturating_duration_since(s.received));
                let Some(addr) = self.info.transfer_addr else { return };
                let handle = PdHandle {
                    addr,
                    transfer: key.transfer,
                    epoch: key.epoch,
                    shm: self.info.kv_shm_path.as_ref().map(|p| p.display().to_string()),
                };
                let usage = Usage { prompt_tokens: s.prompt_tokens, completion_tokens: 1, cached_tokens: 0 };
                self.out.push(Output::Prefilled {
                    id: Id(id),
                    handle,
                    usage,
                    timings: timings(&s, times, now),
                });
            }
            Reply::Finished { id, outcome, output_tokens, times } => {
                let Some(mut s) = lock(&self.live).remove(id) else { return };
                let now = Instant::now();
                self.metrics.e2e.record(now.saturating_duration_since(s.received));
                let finish = if s.stopped { Finish::Stop } else { finish(self.info.role, &outcome) };
                if finish.reason().is_some() && !s.stopped {
                    // The rest of the text: what the decoder and the stop-string check still held.
                    let rest = s.detok.finish(&self.codec).unwrap_or_default();
                    s.pending.push_str(&rest);
                    if !s.pending.is_empty() {
                        let text = std::mem::take(&mut s.pending);
                        self.out.push(Output::Text { id: Id(id), text, logprob: None });
                    }
                }
                // Tokens are counted as they reach this side; the engine thread's count says the same
                // unless a reply was lost to a stuck caller.
                debug_assert!(output_tokens >= s.completion_tokens || s.stopped);
                let timings = timings(&s, times, now);
                self.out.push(Output::Finished { id: Id(id), finish, usage: s.usage(), timings });
            }
        }
    }

    fn token(&mut self, id: u64, token: u32, logprob: f32, top: Vec<(u32, f32)>, stop: bool) {
        let now = Instant::now();
        let mut live = lock(&self.live);
        let Some(s) = live.streams.get_mut(&id) else { return };
        match s.last_token {
            None => {
                self.metrics.ttft.record(now.saturating_duration_since(s.received));
                s.first_token_at = Some(now);
            }
            Some(t) => self.metrics.itl.record(now.saturating_duration_since(t)),
        }
        s.last_token = Some(now);
        s.completion_tokens += 1;
        if stop || s.stopped {
            return; // stop tokens are not text
        }
        let codec = &self.codec;
        let piece = s.detok.push(codec, token).unwrap_or_default();
        let logprob = s.logprobs.then(|| {
            let name = |t: u32| codec.decode(&[t], false).unwrap_or_default();
            TokenLogprob {
                token: name(token),
                logprob,
                top: top.iter().map(|&(t, p)| (name(t), p)).collect(),
            }
        });
        s.pending.push_str(&piece);
        let (text, hit) = apply_stop(&mut s.pending, &s.stop);
        if hit {
            s.stopped = true;
            let _ = self.commands.try_send(Command::Abort(id));
        }
        drop(live);
        if !text.is_empty() || logprob.is_some() {
            self.out.push(Output::Text { id: Id(id), text, logprob });
        }
    }
}

/// How the engine thread's outcome reads to the caller, with the stage in the api's words.
fn finish(role: Role, outcome: &Outcome) -> Finish {
    let stage = |s: pdserve_scheduler::Stage| match s {
        pdserve_scheduler::Stage::Queued => Stage::queued(role),
        pdserve_scheduler::Stage::KvTransfer => Stage::KvTransfer,
        pdserve_scheduler::Stage::Prefilling => Stage::Prefilling,
        pdserve_scheduler::Stage::Decoding => Stage::Decoding,
    };
    match outcome {
        Outcome::Completed(FinishReason::Stop) => Finish::Stop,
        Outcome::Completed(FinishReason::Length) | Outcome::PrefillDone { .. } => Finish::Length,
        Outcome::Cancelled => Finish::Cancelled,
        Outcome::TimedOut { stage: s } => Finish::TimedOut { stage: stage(*s) },
        Outcome::Failed { stage: s, reason } => Finish::Failed { stage: stage(*s), reason: reason.clone() },
    }
}

/// Milliseconds in each stage on this engine: unified `queue_ms`, `prefill_ms`, `decode_ms`; prefill
/// `queue_ms`, `prefill_ms`; decode the prefill worker's two as `prefill_queue_ms` and `prefill_ms`,
/// then `transfer_ms`, `decode_queue_ms`, `decode_ms`.
pub(crate) fn timings(s: &Stream, times: Times, end: Instant) -> Timings {
    let ms = |a: Instant, b: Instant| (b.saturating_duration_since(a).as_secs_f64() * 1e4).round() / 10.0;
    let mut t = Vec::new();
    let scheduled = times.scheduled.unwrap_or(end);
    match times.kv_arrived {
        Some(kv) => {
            if let Some((queue_us, prefill_us)) = times.prefill_us {
                t.push(("prefill_queue_ms", (queue_us as f64 / 100.0).round() / 10.0));
                t.push(("prefill_ms", (prefill_us as f64 / 100.0).round() / 10.0));
            }
            t.push(("transfer_ms", ms(s.received, kv)));
            t.push(("decode_queue_ms", ms(kv, scheduled.max(kv))));
            t.push(("decode_ms", ms(scheduled.max(kv), end)));
        }
        None => {
            t.push(("queue_ms", ms(s.received, scheduled)));
            let first = s.first_token_at.unwrap_or(end);
            t.push(("prefill_ms", ms(scheduled, first.max(scheduled))));
            if s.first_token_at.is_some() {
                t.push(("decode_ms", ms(first, end)));
            }
        }
    }
    Timings(t)
}
