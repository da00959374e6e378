//! The handle a program holds: it starts the engine thread, tokenizes and submits requests on the
//! caller's thread, turns the engine thread's tokens back into text (stop strings included) on the
//! caller's thread, and ends anything the engine thread leaves past its deadline.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TrySendError};
use pdserve_api::openai::{TokenLogprob, Usage};
use pdserve_api::pd::PdHandle;
use pdserve_api::{Role, Stage};
use pdserve_kvcache::{KvCache, KvConfig};
use pdserve_model::{IncrementalDecoder, ModelFiles, TextCodec, WeightFormat};
use pdserve_pd_transfer::Source;
use pdserve_scheduler::{FinishReason, Outcome, Scheduler};
use pdserve_telemetry::{Registry, RequestLedger};

use crate::core::{Command, Core, Reply, Shared, Submission, Times};
use crate::metrics::Metrics;
use crate::text::apply_stop;
use crate::{Device, EngineConfig, EngineError, Finish, Id, Input, Output, Request, Timings};

/// What the engine runs, for reports (`/v1/models`) and handles.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    pub role: Role,
    pub device: Device,
    pub weights: WeightFormat,
    /// What steps of more than two rows read: "f32" or "bf16".
    pub multi_row_weights: &'static str,
    /// Prompt plus generated tokens never exceed it.
    pub context_tokens: usize,
    pub vocab_size: usize,
    /// Prefill role: where decode workers pull KV from.
    pub transfer_addr: Option<SocketAddr>,
    /// Prefill role with shared KV memory: its file.
    pub kv_shm_path: Option<PathBuf>,
}

/// How the engine thread is doing, for readiness checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Health {
    /// Since the engine loop last came round.
    pub tick_age: Duration,
    /// Since the last token was sampled (`None`: never).
    pub token_age: Option<Duration>,
    /// Requests waiting and running in the engine.
    pub waiting: usize,
    pub running: usize,
    /// The longest any live request has been in the engine.
    pub oldest: Duration,
}

/// Where an abort found the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Aborted {
    /// It was live; it ends as `Cancelled`.
    Live(Id),
    /// Prefill role: its KV was offered to a decode worker; the offer ends.
    Offered(Id),
}

/// The caller's side of one request.
#[derive(Debug)]
struct Stream {
    request_id: String,
    detok: IncrementalDecoder,
    pending: String,
    stop: Vec<String>,
    /// A stop string was seen: the engine was told to abort, and the end is reported as `Stop`.
    stopped: bool,
    logprobs: bool,
    prompt_tokens: usize,
    completion_tokens: usize,
    received: Instant,
    deadline: Instant,
    first_token_at: Option<Instant>,
    last_token: Option<Instant>,
}

/// The engine. See the [crate docs](crate).
pub struct Engine {
    commands: Sender<Command>,
    replies: Receiver<Reply>,
    shared: Arc<Shared>,
    codec: Arc<TextCodec>,
    info: EngineInfo,
    metrics: Metrics,
    config: EngineConfig,
    streams: HashMap<u64, Stream>,
    by_request_id: HashMap<String, u64>,
    /// Prefill role: recent requests whose KV is (or was) offered, so an abort can end the offer.
    recent_prefills: VecDeque<(String, u64)>,
    id_nonce: u64,
    next_id: u64,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("info", &self.info).field("live", &self.streams.len()).finish()
    }
}

/// Recent prefill requests remembered for aborts of their offers.
const RECENT_PREFILLS_MAX: usize = 4096;

/// A bijection on u64 (splitmix64's finalizer): distinct counters give distinct ids.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Engine {
    /// Loads the model, builds the backend and (prefill and decode roles) the KV transfer endpoint,
    /// and starts the engine thread. `wake` is called (from the engine thread) whenever results are
    /// ready, so a caller's event loop can sleep until then; `|| {}` will do for one that polls.
    pub fn start(config: EngineConfig, wake: Arc<dyn Fn() + Send + Sync>) -> Result<Engine, EngineError> {
        Engine::start_with_transport(config, wake, crate::default_transport)
    }

    /// [`start`](Self::start), with the KV transfer's transport made by `make` (a prefill or decode
    /// engine; a unified one never calls it): another project's transport (RDMA, say) plugs in here.
    pub fn start_with_transport(
        mut config: EngineConfig,
        wake: Arc<dyn Fn() + Send + Sync>,
        make: impl FnOnce(&crate::TransportSpec) -> std::io::Result<Box<dyn pdserve_pd_transfer::Transport>>,
    ) -> Result<Engine, EngineError> {
        let files = ModelFiles::load(&config.model_dir)?;
        let context = files.config.max_position_embeddings.min(config.scheduler.max_context_tokens);
        config.scheduler.max_context_tokens = context;
        config.scheduler.role = match config.role {
            Role::Unified => pdserve_scheduler::Role::Unified,
            Role::Prefill => pdserve_scheduler::Role::Prefill,
            Role::Decode => pdserve_scheduler::Role::Decode,
        };
        let model = files.config.clone();
        let built = crate::load::backend(&config, &model, Arc::new(files.weights))?;
        let endpoint = crate::load::endpoint(&config, &model, built.kv_shm_path.is_some(), make)?;
        let transfer_addr = endpoint.as_ref().and_then(|e| e.local_addr());
        let kv = KvCache::new(KvConfig {
            num_blocks: config.kv_blocks as u32,
            block_size: config.block_size as u32,
        })
        .map_err(|e| EngineError::Config { field: "kv_blocks", value: e.to_string() })?;
        let now = Instant::now();
        let sched = Scheduler::new(config.scheduler.clone(), kv, now);
        let metrics =
            Metrics::new().map_err(|e| EngineError::Config { field: "metrics", value: e.to_string() })?;
        let shared = Arc::new(Shared {
            epoch: now,
            last_tick_ms: Default::default(),
            last_token_ms: Default::default(),
            waiting: Default::default(),
            running: Default::default(),
            ledger: Mutex::new(RequestLedger::new(&config.process_name, config.ledger_capacity)),
        });
        let bound = config.scheduler.max_queued_requests + config.scheduler.max_running_requests + 64;
        let (cmd_tx, cmd_rx) = crossbeam_channel::bounded(bound);
        let (reply_tx, reply_rx) = crossbeam_channel::bounded(bound * config.replies_per_request.max(1));
        let info = EngineInfo {
            role: config.role,
            device: config.device,
            weights: config.weights,
            multi_row_weights: built.multi_row_weights,
            context_tokens: context,
            vocab_size: model.vocab_size,
            transfer_addr,
            kv_shm_path: built.kv_shm_path,
        };
        let core = Core::new(
            sched,
            built.backend,
            endpoint,
            config.role,
            model.eos_token_ids.clone(),
            context,
            model.vocab_size,
            cmd_rx,
            reply_tx,
            wake,
            Arc::clone(&shared),
            metrics.clone(),
        );
        let thread = std::thread::Builder::new().name("engine".into()).spawn(move || core.run())?;
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        Ok(Engine {
            commands: cmd_tx,
            replies: reply_rx,
            shared,
            codec: Arc::new(files.text),
            info,
            metrics,
            config,
            streams: HashMap::new(),
            by_request_id: HashMap::new(),
            recent_prefills: VecDeque::new(),
            id_nonce: mix(nanos as u64 ^ (u64::from(std::process::id()) << 32)),
            next_id: 0,
            thread: Some(thread),
        })
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// The tokenizer and chat template.
    pub fn codec(&self) -> &TextCodec {
        &self.codec
    }

    /// The engine's metrics; a program may register its own beside them.
    pub fn registry(&self) -> &Registry {
        &self.metrics.registry
    }

    /// Live requests.
    pub fn len(&self) -> usize {
        self.streams.len()
    }

    pub fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }

    /// Whether `request_id` is live here.
    pub fn is_live(&self, request_id: &str) -> bool {
        self.by_request_id.contains_key(request_id)
    }

    fn tokens(&self, input: &Input) -> Result<Vec<u32>, EngineError> {
        let invalid = |e: pdserve_model::ModelError| EngineError::InvalidInput { problem: e.to_string() };
        match input {
            Input::Chat(msgs) => {
                let text = self.codec.apply_chat_template(msgs, true).map_err(invalid)?;
                self.codec.encode(&text).map_err(invalid)
            }
            Input::Text(t) => self.codec.encode(t).map_err(invalid),
            Input::Tokens(t) => match t.iter().find(|&&x| x as usize >= self.info.vocab_size) {
                Some(bad) => Err(EngineError::InvalidInput {
                    problem: format!("token id {bad} is outside the vocabulary of {}", self.info.vocab_size),
                }),
                None => Ok(t.clone()),
            },
            Input::Remote(_) => Ok(Vec::new()),
        }
    }

    /// Tokenizes (on this thread) and hands the request to the engine thread. The answer comes
    /// through [`poll`](Self::poll): `Admitted` or `Rejected` first.
    pub fn submit(&mut self, req: Request) -> Result<Id, EngineError> {
        if self.by_request_id.contains_key(&req.request_id) {
            return Err(EngineError::DuplicateRequestId { request_id: req.request_id });
        }
        let remote = match (&req.input, self.info.role) {
            (Input::Remote(h), Role::Decode) => Some(Source {
                addr: h.addr,
                key: pdserve_pd_transfer::TransferKey { transfer: h.transfer, epoch: h.epoch },
                region: h.shm.clone(),
            }),
            (Input::Remote(_), role) => {
                return Err(EngineError::InvalidInput {
                    problem: format!("a {role} engine computes its prompts; it takes no remote KV"),
                })
            }
            (_, Role::Decode) => {
                return Err(EngineError::InvalidInput {
                    problem: "a decode engine takes only prompts a prefill worker computed (a KV handle)"
                        .into(),
                })
            }
            _ => None,
        };
        // A full queue answers at once, without a round trip to the engine thread.
        let waiting = self.shared.waiting.load(Ordering::Relaxed);
        let limit = self.config.scheduler.max_queued_requests;
        if waiting >= limit {
            return Err(EngineError::QueueFull { waiting, limit });
        }
        let tokens = self.tokens(&req.input)?;
        if remote.is_none() {
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
        self.next_id += 1;
        let id = mix(self.id_nonce.wrapping_add(self.next_id));
        let prompt_tokens = tokens.len();
        let sub = Submission {
            id,
            request_id: req.request_id.clone(),
            tokens,
            remote,
            max_tokens: req.max_tokens,
            params: req.sampling,
            seed: req.seed.unwrap_or_else(|| mix(id ^ 0x5eed)),
            stop_ids: req.stop_token_ids,
            ignore_eos: req.ignore_eos,
            deadline: req.deadline,
        };
        match self.commands.try_send(Command::Submit(Box::new(sub))) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                return Err(EngineError::Busy { limit: self.commands.capacity().unwrap_or(0) })
            }
            Err(TrySendError::Disconnected(_)) => return Err(EngineError::Stopped),
        }
        self.streams.insert(
            id,
            Stream {
                request_id: req.request_id.clone(),
                detok: IncrementalDecoder::new(),
                pending: String::new(),
                stop: req.stop,
                stopped: false,
                logprobs: req.logprobs,
                prompt_tokens,
                completion_tokens: 0,
                received: Instant::now(),
                deadline: req.deadline,
                first_token_at: None,
                last_token: None,
            },
        );
        self.by_request_id.insert(req.request_id, id);
        Ok(Id(id))
    }

    /// Ends a live request (it finishes as `Cancelled`). Idempotent.
    pub fn abort(&mut self, id: Id) -> bool {
        if !self.streams.contains_key(&id.0) {
            return false;
        }
        // A full queue loses the abort; the watchdog then ends the request at its deadline.
        let _ = self.commands.try_send(Command::Abort(id.0));
        true
    }

    /// Ends a request by its caller's name: a live one, or (prefill role) the offer of its KV.
    pub fn abort_request(&mut self, request_id: &str) -> Option<Aborted> {
        if let Some(&id) = self.by_request_id.get(request_id) {
            self.abort(Id(id));
            return Some(Aborted::Live(Id(id)));
        }
        let &(_, id) = self.recent_prefills.iter().find(|(r, _)| r == request_id)?;
        let _ = self.commands.try_send(Command::AbortTransfer(id));
        Some(Aborted::Offered(Id(id)))
    }

    /// How the engine thread is doing.
    pub fn health(&self, now: Instant) -> Health {
        let ms = self.shared.ms_since_epoch(now);
        let tick = self.shared.last_tick_ms.load(Ordering::Relaxed);
        let token = self.shared.last_token_ms.load(Ordering::Relaxed);
        Health {
            tick_age: Duration::from_millis(ms.saturating_sub(tick)),
            token_age: (token > 0).then(|| Duration::from_millis(ms.saturating_sub(token))),
            waiting: self.shared.waiting.load(Ordering::Relaxed),
            running: self.shared.running.load(Ordering::Relaxed),
            oldest: self
                .streams
                .values()
                .map(|s| now.saturating_duration_since(s.received))
                .max()
                .unwrap_or_default(),
        }
    }

    /// The ledger's `/debug/requests` body: live requests older than `older_than`.
    pub fn debug_requests(&self, now: Instant, unix_ms: u64, older_than: Duration) -> serde_json::Value {
        self.shared.ledger().debug_json(now, unix_ms, older_than)
    }

    /// Like [`poll`](Self::poll), but first waits up to `timeout` for the engine thread to say
    /// something (for a program without an event loop of its own).
    pub fn poll_timeout(&mut self, timeout: Duration, out: &mut Vec<Output>) {
        let until = Instant::now() + timeout.min(self.next_watchdog(Instant::now()));
        match self.replies.recv_deadline(until) {
            Ok(r) => self.reply(r, out),
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {}
        }
        self.poll(Instant::now(), out);
    }

    /// Appends what happened since the last call to `out`, and ends (as timed out) requests the
    /// engine thread has left past their deadline plus the grace.
    pub fn poll(&mut self, now: Instant, out: &mut Vec<Output>) {
        while let Ok(r) = self.replies.try_recv() {
            self.reply(r, out);
        }
        self.watchdog(now, out);
    }

    fn next_watchdog(&self, now: Instant) -> Duration {
        self.streams
            .values()
            .map(|s| (s.deadline + self.config.watchdog_grace).saturating_duration_since(now))
            .min()
            .unwrap_or(Duration::MAX)
    }

    fn remove(&mut self, id: u64) -> Option<Stream> {
        let s = self.streams.remove(&id)?;
        self.by_request_id.remove(&s.request_id);
        Some(s)
    }

    fn reply(&mut self, r: Reply, out: &mut Vec<Output>) {
        match r {
            Reply::Admitted { id, prompt_tokens } => {
                if let Some(s) = self.streams.get_mut(&id) {
                    s.prompt_tokens = prompt_tokens;
                    out.push(Output::Admitted { id: Id(id) });
                }
            }
            Reply::Rejected { id, error } => {
                if self.remove(id).is_some() {
                    out.push(Output::Rejected { id: Id(id), error });
                }
            }
            Reply::Token { id, token, logprob, top, stop } => self.token(id, token, logprob, top, stop, out),
            Reply::Prefilled { id, key, times } => {
                let Some(s) = self.remove(id) else {
                    let _ = self.commands.try_send(Command::AbortTransfer(id));
                    return;
                };
                let now = Instant::now();
                self.metrics.e2e.record(now.saturating_duration_since(s.received));
                if self.recent_prefills.len() >= RECENT_PREFILLS_MAX {
                    self.recent_prefills.pop_front();
                }
                self.recent_prefills.push_back((s.request_id.clone(), id));
                let Some(addr) = self.info.transfer_addr else { return };
                let handle = PdHandle {
                    addr,
                    transfer: key.transfer,
                    epoch: key.epoch,
                    shm: self.info.kv_shm_path.as_ref().map(|p| p.display().to_string()),
                };
                let usage = Usage { prompt_tokens: s.prompt_tokens, completion_tokens: 1, cached_tokens: 0 };
                out.push(Output::Prefilled { id: Id(id), handle, usage, timings: timings(&s, times, now) });
            }
            Reply::Finished { id, outcome, output_tokens, times } => {
                let Some(mut s) = self.remove(id) else { return };
                let now = Instant::now();
                self.metrics.e2e.record(now.saturating_duration_since(s.received));
                let finish = if s.stopped { Finish::Stop } else { self.finish(&outcome) };
                if finish.reason().is_some() && !s.stopped {
                    // The rest of the text: what the decoder and the stop-string check still held.
                    let rest = s.detok.finish(&self.codec).unwrap_or_default();
                    s.pending.push_str(&rest);
                    if !s.pending.is_empty() {
                        out.push(Output::Text {
                            id: Id(id),
                            text: std::mem::take(&mut s.pending),
                            logprob: None,
                        });
                    }
                }
                // Tokens are counted as they reach this side; the engine thread's count says the same
                // unless a reply was lost to a stuck caller.
                debug_assert!(output_tokens >= s.completion_tokens || s.stopped);
                let usage = Usage {
                    prompt_tokens: s.prompt_tokens,
                    completion_tokens: s.completion_tokens,
                    cached_tokens: 0,
                };
                let timings = timings(&s, times, now);
                out.push(Output::Finished { id: Id(id), finish, usage, timings });
            }
        }
    }

    fn finish(&self, outcome: &Outcome) -> Finish {
        let stage = |s: pdserve_scheduler::Stage| match s {
            pdserve_scheduler::Stage::Queued => Stage::queued(self.info.role),
            pdserve_scheduler::Stage::KvTransfer => Stage::KvTransfer,
            pdserve_scheduler::Stage::Prefilling => Stage::Prefilling,
            pdserve_scheduler::Stage::Decoding => Stage::Decoding,
        };
        match outcome {
            Outcome::Completed(FinishReason::Stop) => Finish::Stop,
            Outcome::Completed(FinishReason::Length) | Outcome::PrefillDone { .. } => Finish::Length,
            Outcome::Cancelled => Finish::Cancelled,
            Outcome::TimedOut { stage: s } => Finish::TimedOut { stage: stage(*s) },
            Outcome::Failed { stage: s, reason } => {
                Finish::Failed { stage: stage(*s), reason: reason.clone() }
            }
        }
    }

    fn token(
        &mut self,
        id: u64,
        token: u32,
        logprob: f32,
        top: Vec<(u32, f32)>,
        stop: bool,
        out: &mut Vec<Output>,
    ) {
        let now = Instant::now();
        let Some(s) = self.streams.get_mut(&id) else { return };
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
        if !text.is_empty() || logprob.is_some() {
            out.push(Output::Text { id: Id(id), text, logprob });
        }
    }

    /// Ends requests the engine thread has not ended by their deadline plus a grace period (a stuck
    /// engine): the caller gets the end, the engine thread an abort.
    fn watchdog(&mut self, now: Instant, out: &mut Vec<Output>) {
        let grace = self.config.watchdog_grace;
        let overdue: Vec<u64> =
            self.streams.iter().filter(|(_, s)| now > s.deadline + grace).map(|(&id, _)| id).collect();
        for id in overdue {
            let _ = self.commands.try_send(Command::Abort(id));
            let Some(s) = self.remove(id) else { continue };
            // The stage the engine last recorded for it (queued if it never got that far).
            let stage =
                self.shared.ledger().get(&s.request_id).map_or(Stage::queued(self.info.role), |e| e.stage);
            let usage = Usage {
                prompt_tokens: s.prompt_tokens,
                completion_tokens: s.completion_tokens,
                cached_tokens: 0,
            };
            let timings = timings(&s, Times::default(), now);
            out.push(Output::Finished { id: Id(id), finish: Finish::TimedOut { stage }, usage, timings });
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Closing the command channel ends the engine thread's loop.
        let (tx, _) = crossbeam_channel::bounded(1);
        drop(std::mem::replace(&mut self.commands, tx));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Milliseconds in each stage on this engine: unified `queue_ms`, `prefill_ms`, `decode_ms`; prefill
/// `queue_ms`, `prefill_ms`; decode the prefill worker's two as `prefill_queue_ms` and `prefill_ms`,
/// then `transfer_ms`, `decode_queue_ms`, `decode_ms`.
fn timings(s: &Stream, times: Times, end: Instant) -> Timings {
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
