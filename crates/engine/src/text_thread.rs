//! The text thread: between the caller and the engine thread, it turns requests into token ids (chat
//! template, tokenizer, the prompt checks) and the engine thread's tokens back into text (incremental
//! decoding, stop strings, log-probabilities by name), so neither the caller's thread (a server's
//! event loop) nor the engine thread ever waits on text work.
//!
//! The requests alive on the caller's side are one table, [`Streams`], shared with the handle: whoever
//! removes a request from it (this thread at its end, or the handle's watchdog at its deadline) is the
//! one that reports its end, so it is reported exactly once. Each request's text state is this
//! thread's alone, so the table's lock is never held over text work.
//!
//! This thread never waits on the caller: outputs the caller has not taken yet wait in a backlog
//! (text is dropped past a bound, ends never are), while replies keep being drained, so the engine
//! thread never waits on a caller that stopped polling either.

use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TrySendError};
use pdserve_api::generation::{TokenLogprob, Usage};
use pdserve_api::pd::PdHandle;
use pdserve_api::{Role, Stage};
use pdserve_model::{IncrementalDecoder, TextCodec};
use pdserve_scheduler::{Exit, FinishReason};

use crate::core::{output_budget, Reply, Submission, Times};
use crate::grammar::{CompileJob, Compiler};
use crate::info::EngineInfo;
use crate::metrics::Metrics;
use crate::shell::Command;
use crate::text::apply_stop;
use crate::{EngineError, Finish, Id, Input, Output, Timings};
use pdserve_api::generation::Constraint;
use pdserve_api::tools::ToolChoice;
use pdserve_chat_template::{Piece, ReasoningFormat, ReasoningParser, Split, ToolCallParser};

mod staging;

pub(crate) use staging::{Compiling, Staged};

/// Recent prefill requests remembered for aborts of their offers.
const RECENT_PREFILLS_MAX: usize = 4096;

/// Outputs held for a caller that is not polling; past this, text is dropped (ends never are).
const BACKLOG_MAX: usize = 65_536;

/// What the handle asks of the text thread, in order.
#[derive(Debug)]
pub(crate) enum Job {
    /// Tokenize and check a request, then hand it to the engine thread.
    Submit(Box<NewRequest>),
    /// Passed on to the engine thread in order (an abort never overtakes its request's submission).
    Command(Command),
}

/// A request for the text thread: `input` becomes the submission's prompt; its text ends before any
/// of `stop`, with each token's log-probability if `logprobs`, and the tool calls in it lifted out.
#[derive(Debug)]
pub(crate) struct NewRequest {
    pub sub: Box<Submission>,
    pub input: Input,
    pub tools: Vec<pdserve_api::tools::Tool>,
    pub tool_choice: ToolChoice,
    pub parallel_tool_calls: bool,
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Split a thinking model's thinking from the answer (`None`: for chat input).
    pub reasoning: Option<bool>,
    /// What the request's call ids begin with.
    pub tool_call_ids: String,
    pub constraint: Option<Constraint>,
    pub stop: Vec<String>,
    pub include_stop: bool,
    pub logprobs: bool,
    pub panic_in_text: bool,
}

/// The caller's side of one request: what the handle's watchdog needs to end it.
#[derive(Debug)]
pub(crate) struct Stream {
    pub request_id: String,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV was reused (known at the end).
    pub cached_tokens: usize,
    /// Output tokens generated before this engine (counted in `completion_tokens`).
    pub resumed: usize,
    pub received: Instant,
    pub deadline: Instant,
    first_token_at: Option<Instant>,
    last_token: Option<Instant>,
}

impl Stream {
    pub(crate) fn new(request_id: String, deadline: Instant) -> Stream {
        Stream {
            request_id,
            prompt_tokens: 0,
            completion_tokens: 0,
            cached_tokens: 0,
            resumed: 0,
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
            cached_tokens: self.cached_tokens,
        }
    }
}

/// Every request alive on the caller's side.
#[derive(Debug, Default)]
pub(crate) struct Streams {
    pub streams: HashMap<u64, Stream>,
    pub by_request_id: HashMap<String, u64>,
    /// Prefill role: recent requests whose KV is (or was) offered, so an abort can end the offer.
    pub recent_prefills: VecDeque<(String, u64)>,
}

impl Streams {
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

pub(crate) fn lock(live: &Mutex<Streams>) -> MutexGuard<'_, Streams> {
    live.lock().unwrap_or_else(|e| e.into_inner())
}

/// One request's text, which only this thread touches.
#[derive(Debug)]
pub(crate) struct Text {
    detok: IncrementalDecoder,
    pending: String,
    stop: Vec<String>,
    include_stop: bool,
    /// The stop string seen: the engine was told to abort, and the end is reported as `StopString`.
    stopped: Option<String>,
    logprobs: bool,
    /// Tokens consumed since the last `Text` output (it names them).
    unsent: Vec<u32>,
    /// A thinking model's chat: splits the thinking from the answer (before the tool-call parser,
    /// which sees the answer only).
    thinking: Option<ReasoningParser>,
    /// Tools offered: lifts the model's calls out of its text.
    parser: Option<ToolCallParser>,
    /// The model made a call (its end is then `Finish::ToolCalls`).
    called: bool,
    /// The most calls the answer makes: the one that reaches it ends the answer.
    calls_max: usize,
    /// The answer made its last allowed call: the engine was told to abort, and nothing after the
    /// call is given out.
    calls_done: bool,
    /// Test hook: turning this request's tokens into text panics.
    panic: bool,
}

impl Text {
    /// Holds `pieces` (the newest, after the parser's earlier ones) to the answer's call limit:
    /// nothing after the call that reaches it. Whether the limit is reached (the answer is over).
    fn limit_calls(&mut self, pieces: &mut Vec<Piece>) -> bool {
        let Some(p) = self.parser.as_ref().filter(|p| p.calls() >= self.calls_max) else { return false };
        let here = pieces.iter().filter(|p| matches!(p, Piece::Call(_))).count();
        let allowed = self.calls_max.saturating_sub(p.calls() - here);
        let keep = match allowed {
            0 => pieces
                .iter()
                .position(|p| matches!(p, Piece::Call(_) | Piece::CallBegin { .. }))
                .unwrap_or(pieces.len()),
            n => pieces
                .iter()
                .enumerate()
                .filter(|(_, p)| matches!(p, Piece::Call(_)))
                .nth(n - 1)
                .map_or(pieces.len(), |(i, _)| i + 1),
        };
        pieces.truncate(keep);
        self.calls_done = true;
        true
    }
}

/// The text thread. See the [module docs](self).
pub(crate) struct TextThread {
    pub jobs: Receiver<Job>,
    pub replies: Receiver<Vec<Reply>>,
    pub commands: Sender<Command>,
    pub outputs: Sender<Output>,
    pub wake: Arc<dyn Fn() + Send + Sync>,
    pub live: Arc<Mutex<Streams>>,
    pub codec: Arc<TextCodec>,
    pub info: EngineInfo,
    pub metrics: Metrics,
    /// Text state of the requests this thread has passed on, by id.
    pub texts: HashMap<u64, Text>,
    /// Outputs the caller has not taken yet, in order.
    pub backlog: VecDeque<Output>,
    /// Compiles requests' output constraints.
    pub compiler: Compiler,
    /// Requests waiting for their constraint.
    pub compiling: HashMap<u64, Compiling>,
    /// How long a constraint may take to compile (`EngineConfig::grammar_compile_timeout`).
    pub compile_timeout: Duration,
}

impl TextThread {
    /// Runs until the handle is dropped (its job channel closes), then drops the engine thread's
    /// command channel, which ends that thread too.
    pub(crate) fn run(mut self) {
        let mut turns = 0u64;
        loop {
            // With a backlog, its delivery is retried every 10 ms.
            let mut retry =
                if self.backlog.is_empty() { Duration::from_secs(1) } else { Duration::from_millis(10) };
            if let Some(first) = self.compiling.values().filter_map(|c| c.due(self.compile_timeout)).min() {
                retry = retry.min(first.saturating_duration_since(Instant::now()));
            }
            crossbeam_channel::select! {
                recv(self.compiler.done) -> c => if let Ok(c) = c { self.compile(c) },
                recv(self.jobs) -> job => match job {
                    Ok(job) => self.job(job),
                    Err(_) => return,
                },
                recv(self.replies) -> replies => match replies {
                    Ok(replies) => replies.into_iter().for_each(|r| self.reply(r)),
                    // The engine thread is gone; the handle's watchdog ends what is left.
                    Err(_) => self.replies = crossbeam_channel::never(),
                },
                default(retry) => {}
            }
            if !self.compiling.is_empty() {
                self.compile_timeouts(Instant::now());
            }
            // Take what else is ready before waking the caller, a bounded amount.
            for _ in 0..256 {
                match self.replies.try_recv() {
                    Ok(replies) => replies.into_iter().for_each(|r| self.reply(r)),
                    Err(_) => break,
                }
            }
            self.deliver();
            turns += 1;
            if turns.is_multiple_of(1024) {
                // Text state of requests the handle's watchdog ended and no end came for.
                let live = lock(&self.live);
                self.texts.retain(|id, _| live.streams.contains_key(id));
            }
        }
    }

    /// Hands the backlog to the caller in order, as far as its channel takes it, and wakes it.
    fn deliver(&mut self) {
        let mut sent = false;
        while let Some(o) = self.backlog.pop_front() {
            match self.outputs.try_send(o) {
                Ok(()) => sent = true,
                Err(TrySendError::Full(o)) => {
                    self.backlog.push_front(o);
                    break;
                }
                // The handle is being dropped.
                Err(TrySendError::Disconnected(_)) => self.backlog.clear(),
            }
        }
        if self.backlog.len() > BACKLOG_MAX {
            // A caller that stopped polling: keep every request's end, drop text it will not read.
            let before = self.backlog.len();
            self.backlog.retain(|o| !matches!(o, Output::Text { .. } | Output::Admitted { .. }));
            eprintln!("engine: the caller is not polling; {} outputs dropped", before - self.backlog.len());
        }
        if sent {
            (self.wake)();
        }
    }

    fn push(&mut self, o: Output) {
        self.backlog.push_back(o);
    }

    fn job(&mut self, job: Job) {
        match job {
            Job::Submit(job) => {
                let NewRequest {
                    mut sub,
                    input,
                    tools,
                    tool_choice,
                    parallel_tool_calls,
                    chat_template_kwargs,
                    reasoning,
                    tool_call_ids,
                    constraint,
                    stop,
                    include_stop,
                    logprobs,
                    panic_in_text,
                } = *job;
                let id = sub.id;
                let resumed = sub.resumed.clone();
                // Tools offered: in the prompt, and the model's calls lifted out of its text; a call
                // required: a grammar over the model's call format (in place of the request's own
                // constraint, which the API allows only without one).
                let format = self.info.tool_format;
                let offered = tool_choice != ToolChoice::None && !tools.is_empty();
                let calls_max = if parallel_tool_calls { self.info.tool_calls_max } else { 1 };
                let constraint = match &tool_choice {
                    ToolChoice::Required if offered => {
                        Some(Constraint::Lark(format.forced_call_grammar(&tools, None, calls_max)))
                    }
                    ToolChoice::Function(name) if offered => {
                        Some(Constraint::Lark(format.forced_call_grammar(&tools, Some(name), 1)))
                    }
                    // `strict` tools under auto: free text, or text and then calls whose arguments
                    // fit their schemas (the grammar takes hold at the format's opener).
                    ToolChoice::Auto if offered && constraint.is_none() && tools.iter().any(|t| t.strict) => {
                        format.auto_call_grammar(&tools, calls_max).map(Constraint::Lark)
                    }
                    _ => constraint,
                };
                let free_start = constraint.is_none()
                    || (tool_choice == ToolChoice::Auto && offered && tools.iter().any(|t| t.strict));
                let calls_max = if matches!(tool_choice, ToolChoice::Function(_)) { 1 } else { calls_max };
                let parser = offered.then(|| ToolCallParser::new(format, &tools, &tool_call_ids));
                let tools = if offered { tools } else { Vec::new() };
                // A thinking model's chat: its thinking split from the answer. An answer under a
                // constraint (a forced call, a schema) starts with what the constraint allows.
                let reasoning_format = self.info.reasoning_format;
                let split = reasoning.unwrap_or(matches!(input, Input::Chat(_)))
                    && reasoning_format != ReasoningFormat::None;
                let thinking = split.then(|| {
                    let opened = free_start
                        && crate::chat::opens_thinking(&self.codec, reasoning_format, &chat_template_kwargs);
                    ReasoningParser::new(opened)
                });
                match self.prompt(&input, &tools, &chat_template_kwargs, sub.remote.is_some(), &resumed) {
                    Ok(tokens) => sub.tokens = tokens,
                    Err(e) => return self.reject(id, e),
                }
                let text = Text {
                    detok: IncrementalDecoder::new(),
                    pending: String::new(),
                    stop,
                    include_stop,
                    stopped: None,
                    logprobs,
                    unsent: Vec::new(),
                    thinking,
                    parser,
                    called: false,
                    calls_max,
                    calls_done: false,
                    panic: panic_in_text,
                };
                let staged = Staged { sub, text };
                let Some(constraint) = constraint else { return self.start(staged) };
                // Compiled on a thread of its own; the request goes on when it is.
                let deadline = staged.sub.deadline;
                let cancel = Arc::new(std::sync::atomic::AtomicBool::new(false));
                if !self.compiler.submit(CompileJob { id, constraint, deadline, cancel: Arc::clone(&cancel) })
                {
                    let limit = self.compiler.capacity();
                    return self.reject(id, EngineError::Busy { limit });
                }
                let queued = Instant::now();
                self.compiling.insert(id, Compiling { staged, queued, started: None, cancel });
            }
            // An abort of a request still compiling its constraint ends it here: the engine thread
            // has not seen it.
            Job::Command(Command::Abort(id)) if self.compiling.contains_key(&id) => {
                if let Some(c) = self.compiling.remove(&id) {
                    c.cancel.store(true, std::sync::atomic::Ordering::Relaxed);
                }
                self.end_resumed(id, Finish::Cancelled);
            }
            // A full queue loses the abort; the watchdog then ends the request at its deadline.
            Job::Command(c) => {
                let _ = self.commands.try_send(c);
            }
        }
    }

    /// The prompt's token ids (followed by the `resumed` output), checked against the vocabulary and
    /// the context.
    fn prompt(
        &self,
        input: &Input,
        tools: &[pdserve_api::tools::Tool],
        kwargs: &serde_json::Map<String, serde_json::Value>,
        remote: bool,
        resumed: &[u32],
    ) -> Result<Vec<u32>, EngineError> {
        let mut tokens = crate::chat::tokens(&self.codec, &self.info, input, tools, kwargs)?;
        if let Some(t) = resumed.iter().find(|&&t| t as usize >= self.info.vocab_size) {
            let problem = format!("resumed token {t} is outside the vocabulary of {}", self.info.vocab_size);
            return Err(EngineError::InvalidInput { problem });
        }
        if !remote {
            let prompt_len = tokens.len();
            tokens.extend_from_slice(resumed);
            if prompt_len == 0 {
                return Err(EngineError::InvalidInput { problem: "the prompt is empty".into() });
            }
            // (A resumed request that filled the context ends with `length` instead.)
            output_budget(tokens.len(), resumed.len(), None, self.info.context_tokens)?;
        }
        Ok(tokens)
    }

    /// A request that ends before the engine thread sees it (a resumed one that was over before it
    /// came here, or one aborted while its constraint compiled): it ends at once, no engine work.
    fn end_resumed(&mut self, id: u64, finish: Finish) {
        self.texts.remove(&id);
        let gone = lock(&self.live).remove(id);
        if let Some(s) = gone {
            let timings = timings(&s, Times::default(), Instant::now());
            self.push(Output::Finished { id: Id(id), finish, usage: s.usage(), timings });
        }
    }

    fn reject(&mut self, id: u64, error: EngineError) {
        self.texts.remove(&id);
        if lock(&self.live).remove(id).is_some() {
            if let Ok(c) = self.metrics.rejected.with(&[error.kind().as_str()]) {
                c.inc();
            }
            self.push(Output::Rejected { id: Id(id), error });
        }
    }

    fn reply(&mut self, r: Reply) {
        match r {
            Reply::Admitted { id, prompt_tokens } => {
                let admitted = match lock(&self.live).streams.get_mut(&id) {
                    Some(s) => {
                        s.prompt_tokens = prompt_tokens;
                        true
                    }
                    None => false,
                };
                if admitted {
                    self.push(Output::Admitted { id: Id(id) });
                }
            }
            Reply::Rejected { id, error } => {
                self.texts.remove(&id);
                if lock(&self.live).remove(id).is_some() {
                    self.push(Output::Rejected { id: Id(id), error });
                }
            }
            Reply::Token { id, token, logprob, top, stop } => {
                // A panic while turning one request's token into text (a tokenizer or stop-string
                // bug) fails that request only.
                let r = catch_unwind(AssertUnwindSafe(|| self.token(id, token, logprob, top, stop)));
                if let Err(p) = r {
                    let reason =
                        format!("internal error while detokenizing: {}", crate::core::panic_text(&p));
                    self.fail(id, reason);
                }
            }
            Reply::Prefilled { id, key, cached_tokens, times } => {
                self.texts.remove(&id);
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
                let timings = timings(&s, times, now);
                let Some(addr) = self.info.transfer_addr else {
                    // `Engine::start` refuses a prefill engine whose transport does not listen.
                    let reason = "this prefill engine's transport has no address".to_owned();
                    let finish = Finish::Failed { stage: Stage::Prefilling, reason };
                    self.push(Output::Finished { id: Id(id), finish, usage: s.usage(), timings });
                    return;
                };
                let handle = PdHandle {
                    addr,
                    transfer: key.transfer,
                    epoch: key.epoch,
                    shm: self.info.kv_shm_path.as_ref().map(|p| p.display().to_string()),
                    ucx: self.info.kv_ucx_region.clone(),
                    // (Signed by the frontend, which holds the stack's secret and the request's trace.)
                    tag: None,
                    traceparent: None,
                };
                let usage = Usage { prompt_tokens: s.prompt_tokens, completion_tokens: 1, cached_tokens };
                self.push(Output::Prefilled { id: Id(id), handle, usage, timings });
            }
            Reply::Served { id, outcome } => self.push(Output::Served { id: Id(id), outcome }),
            Reply::Finished { id, outcome, output_tokens, cached_tokens, times, .. } => {
                let text = self.texts.remove(&id);
                let Some(mut s) = lock(&self.live).remove(id) else { return };
                s.cached_tokens = cached_tokens;
                let now = Instant::now();
                self.metrics.e2e.record(now.saturating_duration_since(s.received));
                let matched = text.as_ref().and_then(|t| t.stopped.clone());
                let stopped = matched.is_some();
                let finish = match matched {
                    Some(s) => Finish::StopString(s),
                    None if text.as_ref().is_some_and(|t| t.calls_done) => Finish::ToolCalls,
                    None => finish(self.info.role, &outcome),
                };
                let mut finish = finish;
                let cut = finish == Finish::Length;
                if let Some(mut t) = text.filter(|t| finish.reason().is_some() && !t.calls_done) {
                    // The rest of the text: what the decoder and the stop-string check still held
                    // (nothing past a stop string), then what the tool-call parser held: calls if they
                    // parse, text if not. Named by no tokens: it goes out with the end (a request
                    // moved before its end makes these tokens, and this text, again).
                    let codec = &self.codec;
                    let rest = catch_unwind(AssertUnwindSafe(|| {
                        let mut rest = std::mem::take(&mut t.pending);
                        if !stopped {
                            rest.push_str(&t.detok.finish(codec).unwrap_or_default());
                        }
                        let (thought, answer) = match t.thinking.as_mut() {
                            Some(r) => {
                                let mut splits = r.push(&rest);
                                splits.extend(r.finish());
                                split_text(splits)
                            }
                            None => (String::new(), rest),
                        };
                        let mut pieces = match t.parser.as_mut() {
                            Some(p) => p.push(&answer),
                            None => vec![Piece::Text(answer)],
                        };
                        pieces.extend(t.parser.as_mut().map(|p| p.finish(cut)).unwrap_or_default());
                        // (Formats whose calls come out only at the end are held to the limit here.)
                        t.limit_calls(&mut pieces);
                        (thought, pieces)
                    }));
                    match rest {
                        Ok((thought, pieces)) => {
                            t.called |= pieces.iter().any(|p| matches!(p, Piece::Call(_)));
                            self.push_pieces(id, thought, pieces, None, Vec::new(), false);
                            // An answer that made calls and stopped stopped for them. One cut by
                            // max_tokens stays `Length` (its last call's arguments may be cut): each
                            // dialect says so its own way (chat: `tool_calls` whenever calls were
                            // made; Responses: incomplete; Anthropic: max_tokens).
                            if t.called && matches!(finish, Finish::Stop | Finish::StopString(_)) {
                                finish = Finish::ToolCalls;
                            }
                        }
                        Err(p) => {
                            let reason =
                                format!("internal error while detokenizing: {}", crate::core::panic_text(&p));
                            finish = Finish::Failed { stage: Stage::Decoding, reason };
                        }
                    }
                }
                // Tokens are counted as they reach this side; the engine thread's count says the same.
                debug_assert!(output_tokens + s.resumed >= s.completion_tokens || stopped);
                let timings = timings(&s, times, now);
                self.push(Output::Finished { id: Id(id), finish, usage: s.usage(), timings });
            }
        }
    }

    /// Ends live request `id` here, with an error naming `reason` (its client learns at once, whatever
    /// the engine thread's queue holds), and asks the engine thread to drop it (best effort: a full
    /// queue leaves it to end at its own limits, unseen).
    fn fail(&mut self, id: u64, reason: String) {
        self.texts.remove(&id);
        let gone = lock(&self.live).remove(id);
        if let Some(s) = gone {
            let timings = timings(&s, Times::default(), Instant::now());
            let finish = Finish::Failed { stage: Stage::Decoding, reason: reason.clone() };
            self.push(Output::Finished { id: Id(id), finish, usage: s.usage(), timings });
        }
        let _ = self.commands.try_send(Command::Fail { id, reason });
    }

    fn token(&mut self, id: u64, token: u32, logprob: f32, top: Vec<(u32, f32)>, stop: bool) {
        let now = Instant::now();
        {
            let mut live = lock(&self.live);
            let Some(s) = live.streams.get_mut(&id) else {
                drop(live);
                self.texts.remove(&id);
                return;
            };
            match s.last_token {
                None => {
                    self.metrics.ttft.record(now.saturating_duration_since(s.received));
                    s.first_token_at = Some(now);
                }
                Some(t) => self.metrics.itl.record(now.saturating_duration_since(t)),
            }
            s.last_token = Some(now);
            s.completion_tokens += 1;
        }
        self.text(id, token, logprob, top, stop, false);
    }

    /// Token `token` of request `id` as text: through the incremental decoder and the stop strings.
    fn text(&mut self, id: u64, token: u32, logprob: f32, top: Vec<(u32, f32)>, stop: bool, replayed: bool) {
        let Some(t) = self.texts.get_mut(&id) else { return };
        if stop || t.stopped.is_some() || t.calls_done {
            return; // stop tokens are not text, nor is anything after the answer's end
        }
        t.unsent.push(token);
        assert!(!t.panic, "test panic while detokenizing");
        let codec = &self.codec;
        let piece = t.detok.push(codec, token).unwrap_or_default();
        let logprob = (t.logprobs && !replayed).then(|| {
            let name = |t: u32| codec.decode(&[t], false).unwrap_or_default();
            TokenLogprob {
                token: name(token),
                logprob,
                top: top.iter().map(|&(t, p)| (name(t), p)).collect(),
            }
        });
        t.pending.push_str(&piece);
        let (text, hit) = apply_stop(&mut t.pending, &t.stop, t.include_stop);
        if let Some(i) = hit {
            t.stopped = Some(t.stop[i].clone());
            let _ = self.commands.try_send(Command::Abort(id));
        }
        if !text.is_empty() || logprob.is_some() {
            let tokens = std::mem::take(&mut t.unsent);
            let (thought, text) = match t.thinking.as_mut() {
                Some(r) => split_text(r.push(&text)),
                None => (String::new(), text),
            };
            let mut pieces = match t.parser.as_mut() {
                Some(p) => p.push(&text),
                None => vec![Piece::Text(text)],
            };
            t.called |= pieces.iter().any(|p| matches!(p, Piece::Call(_)));
            if t.limit_calls(&mut pieces) {
                // The last call allowed (one without parallel calls): the answer ends with it.
                let _ = self.commands.try_send(Command::Abort(id));
            }
            self.push_pieces(id, thought, pieces, logprob, tokens, replayed);
        }
    }

    /// Thinking, then text and calls, in order, as `Text` outputs: each holds a run of text and the
    /// calls after it; the first carries the thinking, `logprob` and `tokens`. At least one goes out.
    fn push_pieces(
        &mut self,
        id: u64,
        reasoning: String,
        pieces: Vec<Piece>,
        logprob: Option<TokenLogprob>,
        tokens: Vec<u32>,
        replayed: bool,
    ) {
        let mut out = (String::new(), Vec::new());
        let (mut logprob, mut tokens, mut reasoning) = (logprob, tokens, reasoning);
        let mut any = false;
        for p in pieces {
            match p {
                Piece::Text(t) if !out.1.is_empty() => {
                    let (text, calls) = std::mem::replace(&mut out, (t, Vec::new()));
                    let (logprob, tokens) = (logprob.take(), std::mem::take(&mut tokens));
                    let reasoning = std::mem::take(&mut reasoning);
                    self.push(Output::Text { id: Id(id), text, reasoning, calls, logprob, tokens, replayed });
                    any = true;
                }
                Piece::Text(t) => out.0.push_str(&t),
                call => out.1.push(call),
            }
        }
        let (text, calls) = out;
        let more = !text.is_empty() || !reasoning.is_empty() || !calls.is_empty();
        if !any || more || logprob.is_some() || !tokens.is_empty() {
            self.push(Output::Text { id: Id(id), text, reasoning, calls, logprob, tokens, replayed });
        }
    }
}

/// Thinking and answer text of `splits`, each joined.
fn split_text(splits: Vec<Split>) -> (String, String) {
    let (mut thought, mut answer) = (String::new(), String::new());
    for s in splits {
        match s {
            Split::Reasoning(t) => thought.push_str(&t),
            Split::Content(t) => answer.push_str(&t),
        }
    }
    (thought, answer)
}

/// How the engine thread's outcome reads to the caller, with the stage in the api's words.
fn finish(role: Role, outcome: &Exit) -> Finish {
    let stage = |s: pdserve_scheduler::Stage| match s {
        pdserve_scheduler::Stage::Queued => Stage::queued(role),
        pdserve_scheduler::Stage::KvTransfer => Stage::KvTransfer,
        pdserve_scheduler::Stage::Prefilling => Stage::Prefilling,
        pdserve_scheduler::Stage::Decoding => Stage::Decoding,
    };
    match outcome {
        Exit::Completed(FinishReason::Stop) => Finish::Stop,
        Exit::Completed(FinishReason::Length) | Exit::PrefillDone { .. } => Finish::Length,
        Exit::Cancelled => Finish::Cancelled,
        Exit::TimedOut { stage: s } => Finish::TimedOut { stage: stage(*s) },
        Exit::Failed { stage: s, reason } => Finish::Failed { stage: stage(*s), reason: reason.clone() },
    }
}

/// Milliseconds in each stage on this engine: unified `queue_ms`, `prefill_ms`, `decode_ms`; prefill
/// `queue_ms`, `prefill_ms`; decode the prefill worker's two as `prefill_queue_ms` and `prefill_ms`,
/// then `transfer_ms` (with `kv_pull_ms`, the pull alone), `decode_queue_ms`, `decode_ms`.
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
            if let Some(p) = times.pull_started {
                // The pull alone, from this engine's first frame until the KV is usable (the last
                // block in place and the prefill worker's confirmation that their lease held): the
                // transfer between the two processes, to the microsecond (a 2,048-token pull takes
                // about 2.5 ms: a tenth of a millisecond would be 4% of it).
                let us = (kv.saturating_duration_since(p).as_secs_f64() * 1e6).round() / 1e3;
                t.push(("kv_pull_ms", us));
            }
            t.push(("decode_queue_ms", ms(kv, scheduled.max(kv))));
            t.push(("decode_ms", ms(scheduled.max(kv), end)));
            if let Some(p) = times.pulled {
                // What the transfer moved, beside how long it took.
                t.push(("kv_pulled_blocks", p.blocks as f64));
                t.push(("kv_pulled_bytes", p.bytes as f64));
                t.push(("kv_reused_blocks", p.reused_blocks as f64));
            }
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
    if times.drafted > 0 {
        // Speculative decoding: what was drafted for this request, and what its samples kept.
        t.push(("draft_tokens", f64::from(times.drafted)));
        t.push(("draft_accepted_tokens", f64::from(times.accepted)));
    }
    Timings(t)
}
