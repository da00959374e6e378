//! The handle a program holds: it starts the text thread and the engine thread, hands requests to
//! the text thread (which tokenizes them off the caller's thread), gives the caller what the text
//! thread made of the engine thread's tokens, and ends anything left past its deadline.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::core::{CoreConfig, EngineCore, Submission, Times};
use crate::info::{fim_tokens, EngineInfo};
use crate::shell::{Command, EngineThread, Shared, Worker};
use crossbeam_channel::{Receiver, Sender, TrySendError};
use pdserve_api::{Role, Stage};
use pdserve_kvcache::{GroupsConfig, KvGroups};
use pdserve_model::{ModelFiles, TextCodec, WeightFormat};
use pdserve_pd_transfer::Source;
use pdserve_scheduler::Scheduler;
use pdserve_telemetry::{Registry, RequestLedger};

use crate::metrics::Metrics;
use crate::text_thread::{lock, timings, Job, NewRequest, Stream, Streams, TextThread};
use crate::{Device, EngineConfig, EngineError, Finish, Id, Input, Output, Request};

/// How the engine thread is doing, for readiness checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Health {
    /// Since the engine loop last came round.
    pub tick_age: Duration,
    /// Since the last token was sampled (`None`: never).
    pub token_age: Option<Duration>,
    /// Requests waiting and running in the engine.
    pub queued: usize,
    pub running: usize,
    /// KV transfers offered (a prefill engine's, until their decode side has pulled them) or being
    /// pulled (a decode engine's).
    pub transfers: usize,
    /// The longest any live request has been in the engine.
    pub oldest: Duration,
}

/// Where an abort found the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Aborted {
    /// It was in flight; it ends as `Cancelled`.
    InFlight(Id),
    /// Prefill role: its KV was offered to a decode worker; the offer ends.
    Offered(Id),
}

/// The engine. See the [crate docs](crate).
pub struct Engine {
    jobs: Sender<Job>,
    outputs: Receiver<Output>,
    live: Arc<Mutex<Streams>>,
    shared: Arc<Shared>,
    codec: Arc<TextCodec>,
    info: EngineInfo,
    metrics: Metrics,
    config: EngineConfig,
    id_nonce: u64,
    next_id: u64,
    /// Requests the watchdog ended lately: what still comes for them is dropped.
    watchdog_ended: HashSet<u64>,
    watchdog_order: VecDeque<u64>,
    /// The text thread, then the engine thread.
    threads: Vec<JoinHandle<()>>,
}

/// Watchdog-ended requests remembered.
const WATCHDOG_ENDED_MAX: usize = 4096;

/// Threads that compile requests' output constraints (each compile is one thread's work).
const GRAMMAR_THREADS: usize = 2;

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("info", &self.info).field("live", &self.len()).finish()
    }
}

/// A bijection on u64 (splitmix64's finalizer): distinct counters give distinct ids.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Engine {
    /// Loads the model, builds the backend and (prefill and decode roles) the KV transfer endpoint,
    /// and starts the text thread and the engine thread. `wake` is called (from the text thread)
    /// whenever outputs are ready, so a caller's event loop can sleep until then; `|| {}` will do for
    /// one that polls.
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
        // On the CPU each layer is converted to the served format as it is read, so the load never
        // holds the whole model in f32 besides (the GPU backend uploads from the f32 weights).
        // The checkpoint's draft layer is loaded where drafts may come from it (the CPU backend runs it).
        let draft_layer = config.speculative.wants_draft_layer() && config.device == Device::Cpu;
        let mut files = match config.device {
            Device::Cpu => ModelFiles::load_with(&config.model_dir, config.weights, draft_layer)?,
            Device::Cuda(_) => {
                let mut f = ModelFiles::load(&config.model_dir)?;
                f.config.draft_layers = 0;
                f.weights.draft = None;
                f
            }
        };
        config.speculative = config
            .speculative
            .resolve(files.config.draft_layers)
            .map_err(|value| EngineError::Config { field: "speculative", value })?;
        // DeepSeek V4's compact KV needs blocks a multiple of its compression ratios (128 in the
        // release): a shorter block length grows to the next such, the pool keeping its tokens.
        if let Some(m) = files.config.v4.as_ref().map(|v4| v4.block_multiple()) {
            if !config.block_size.is_multiple_of(m) {
                let tokens = config.kv_blocks.saturating_mul(config.block_size);
                let grown = config.block_size.div_ceil(m) * m;
                let asked = std::mem::replace(&mut config.block_size, grown);
                config.kv_blocks = tokens.div_ceil(config.block_size).max(1);
                eprintln!(
                    "engine: KV blocks of {} tokens, not {asked}: DeepSeek V4's compact KV needs a multiple of {m} \
                     ({} blocks, {tokens} tokens)",
                    config.block_size, config.kv_blocks
                );
            }
        }
        // The model's maximum context, unless the configuration asks for less or the KV pool holds
        // less (a longer request could never be admitted; with a sliding window a sequence holds only
        // its window, so the pool does not bound it).
        let pool = match files.config.sliding_window {
            Some(_) if config.role != Role::Prefill => usize::MAX,
            _ => config.kv_blocks.saturating_mul(config.block_size),
        };
        let context = files.config.max_position_embeddings.min(config.scheduler.context_tokens_max).min(pool);
        config.scheduler.context_tokens_max = context;
        config.scheduler.sliding_window = files.config.sliding_window;
        if config.device != Device::Cpu {
            // The context cost was measured for the CPU backend; the GPU backend chunks by tokens.
            config.scheduler.attention_cost_positions = None;
        }
        // `--weights auto`: the checkpoint's own precision on the CPU (the GPU backend runs bf16 from
        // the loaded weights whatever the checkpoint).
        config.weights = match (&files.prepared, &files.v4, config.weights) {
            // DeepSeek V4: its projections held as shipped, whatever their formats.
            (_, Some(v4), WeightFormat::Auto) => v4.weight_format(),
            (_, Some(v4), w) if w == v4.weight_format() => w,
            (_, Some(_), w) => {
                let value = format!("{} (DeepSeek V4 is served in its checkpoint's formats: auto)", w.name());
                return Err(EngineError::Config { field: "weights", value });
            }
            (Some(p), _, _) => p.format(),
            (None, None, WeightFormat::Auto) => WeightFormat::F32,
            (None, None, w) => w,
        };
        config.scheduler.role = match config.role {
            Role::Unified => pdserve_scheduler::Role::Unified,
            Role::Prefill => pdserve_scheduler::Role::Prefill,
            Role::Decode => pdserve_scheduler::Role::Decode,
        };
        let model = files.config.clone();
        let (prepared, v4) = (files.prepared.take(), files.v4.take());
        let built = crate::load::backend(&config, &model, Arc::new(files.weights), prepared, v4)?;
        let endpoint =
            crate::load::endpoint(&config, built.backend.kv_layout(), built.kv_shm_path.as_deref(), make)?;
        let kv_ucx_region = endpoint.as_ref().and_then(pdserve_pd_transfer::Endpoint::region);
        let transfer_addr = endpoint.as_ref().and_then(|e| e.local_addr());
        if config.role == Role::Prefill && transfer_addr.is_none() {
            // Decode workers could not reach this engine's KV: refuse it now, not per request.
            let value = "a transport that listens nowhere".to_owned();
            return Err(EngineError::Config { field: "prefill transport", value });
        }
        // The KV ledger: one group (every model's layers keep one row kind per token here), and the
        // backend's per-request state slots where it keeps one (DeepSeek V4's compact layout).
        let state = built.backend.kv_state();
        let group = kv_group(&model, built.kv_bytes_per_token, config.kv_blocks, state.is_some());
        let mut kv = KvGroups::new(GroupsConfig {
            block_tokens: config.block_size as u32,
            groups: vec![group.clone()],
            state_bytes: state.map_or(0, |s| s.bytes as u32),
            state_slots: state.map_or(0, |s| s.slots as u32),
            state_rewind_tokens: state.map_or(0, |s| s.rewind_tokens as u32),
        })
        .map_err(|e| EngineError::Config { field: "kv_blocks", value: e.to_string() })?;
        let offload = match (&config.kv_offload, config.role) {
            (o, _) if !o.is_on() => None,
            (_, Role::Decode) => {
                // A decode worker's pool is filled by pulls while steps run: no copy order to keep.
                let value = "a decode worker (the tier serves unified and prefill workers)".to_owned();
                return Err(EngineError::Config { field: "kv_offload (--kv-offloading-size)", value });
            }
            (_, _) if state.is_some() => {
                // The tier keeps blocks, not the states a prefix hit here resumes from.
                let value = "a model with per-request state (DeepSeek V4's compact KV)".to_owned();
                return Err(EngineError::Config { field: "kv_offload (--kv-offloading-size)", value });
            }
            (o, _) => {
                let (store, tier) =
                    crate::offload::OffloadStore::new(o, built.backend.kv_layout().block_bytes()).map_err(
                        |e| EngineError::Config {
                            field: "kv_offload (--kv-offload-dir)",
                            value: e.to_string(),
                        },
                    )?;
                kv.enable_tier(tier)
                    .map_err(|e| EngineError::Config { field: "kv_offload", value: e.to_string() })?;
                Some(store)
            }
        };
        let now = Instant::now();
        let sched = Scheduler::new(config.scheduler.clone(), kv, now);
        let metrics = Metrics::new().map_err(EngineError::Metrics)?;
        let block_bytes = endpoint.as_ref().map_or(0, |ep| ep.layout().block_bytes());
        let (bs, nb) = (config.block_size.to_string(), config.kv_blocks.to_string());
        if let Ok(g) = metrics.kv_config.with(&[&bs, &nb]) {
            g.set(config.block_size as f64);
        }
        // vLLM's name for the same, which endpoint pickers read by default.
        let info = pdserve_telemetry::AliasSource::Constant(1.0);
        let labels = [("block_size", bs.as_str()), ("num_gpu_blocks", nb.as_str())];
        let help =
            "The KV cache's configuration in its labels (kv_cache_block_size_tokens), as vLLM reports it.";
        (metrics.registry.peer_alias(
            "vllm:cache_config_info",
            help,
            pdserve_telemetry::MetricKind::Gauge,
            &labels,
            info,
        ))
        .map_err(EngineError::Metrics)?;
        let shared =
            Arc::new(Shared::new(now, RequestLedger::new(&config.process_name, config.ledger_capacity)));
        let bound = config.scheduler.queued_requests_max + config.scheduler.running_requests_max + 64;
        let (cmd_tx, cmd_rx) = crossbeam_channel::bounded(bound);
        let (reply_tx, reply_rx) = crossbeam_channel::bounded(bound * config.replies_per_request.max(1));
        let mut info = EngineInfo {
            role: config.role,
            device: config.device,
            weights: config.weights,
            activations: if config.int8_activations { "q8" } else { "f32" },
            multi_row_weights: built.multi_row_weights,
            weight_bytes: built.weight_bytes,
            kv_bytes: built.kv_bytes,
            kv_bytes_per_token: built.kv_bytes_per_token,
            kv_groups: vec![group],
            kv_state_bytes: state.map_or(0, |s| s.bytes),
            kv_rows: built.kv_rows,
            speculative: config.speculative.name(),
            kv_dtype: config.resolved_kv_dtype(),
            sampling_defaults: files.generation.sampling_defaults(),
            context_tokens: context,
            vocab_size: model.vocab_size,
            transfer_addr,
            kv_shm_path: built.kv_shm_path,
            kv_ucx: config.kv_ucx,
            kv_ucx_region,
            kv_events: None,
            tool_format: config.tool_format.unwrap_or_else(|| {
                files.text.chat_template().map_or(crate::ToolFormat::Hermes, crate::ToolFormat::from_template)
            }),
            tool_calls_max: config.tool_calls_max.max(1),
            reasoning_format: config.reasoning_format.unwrap_or_else(|| {
                files
                    .text
                    .chat_template()
                    .map_or(crate::ReasoningFormat::None, crate::ReasoningFormat::from_template)
            }),
            fim: fim_tokens(|t| files.text.token_id(t).is_some()),
        };
        let eos = model.eos_token_ids.first().copied().unwrap_or(0);
        let tokenizer_json = files.text.tokenizer_json()?;
        let grammars =
            crate::grammar::Grammars::new(&tokenizer_json, model.vocab_size, eos).map_err(|value| {
                EngineError::Config { field: "tokenizer.json (for constrained decoding)", value }
            })?;
        let core = EngineCore::new(
            CoreConfig {
                role: config.role,
                eos_ids: model.eos_token_ids.clone(),
                context_tokens: context,
                vocab_size: model.vocab_size,
                transfer_step_tokens: config.transfer_step_tokens,
                speculative: config.speculative,
                verify_rows: built.backend.verify_rows_multiple(),
                block_bytes,
                block_size: config.block_size,
                kv_state: built.backend.kv_state(),
            },
            sched,
        );
        let worker = Worker::new(core, built.backend, endpoint)
            .with_test_corruption(config.test_corrupt_kv_pull)
            .with_offload(offload);
        // The CPU backend's step may run on any thread; a GPU step stays on the thread whose CUDA
        // context its launches use.
        let step_thread = config.device == Device::Cpu;
        let mut thread =
            EngineThread::new(worker, cmd_rx, reply_tx, Arc::clone(&shared), metrics.clone(), step_thread);
        if let Some(cfg) = &config.kv_events {
            let p = pdserve_kv_events::Publisher::start(cfg).map_err(|e| EngineError::Config {
                field: "kv_events (--kv-events-config)",
                value: format!("{} or its replay endpoint: {e}", cfg.endpoint),
            })?;
            let endpoint = |a: std::net::SocketAddr| {
                if a.ip().is_unspecified() {
                    format!("tcp://*:{}", a.port())
                } else {
                    format!("tcp://{a}")
                }
            };
            // This process's events (a subscriber seeing another instance follows it anew: its
            // sequence numbers start over).
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            let instance = format!("{:016x}", nanos ^ u64::from(std::process::id()).rotate_left(32));
            // A publisher that connects out to a subscriber of its own has no endpoint to advertise:
            // the router cannot follow it and routes on its own estimate.
            info.kv_events = Some(serde_json::json!({
                "endpoint": p.pub_addr().map(endpoint),
                "connects_to": match &cfg.endpoint {
                    pdserve_kv_events::PubEndpoint::Connect(to) => Some(format!("tcp://{to}")),
                    pdserve_kv_events::PubEndpoint::Bind(_) => None,
                },
                "replay_endpoint": p.replay_addr().map(endpoint),
                "topic": cfg.topic,
                "instance": instance,
            }));
            thread = thread.with_kv_events(p);
        }
        let engine_thread = std::thread::Builder::new().name("engine".into()).spawn(move || thread.run())?;
        let codec = Arc::new(files.text);
        let live = Arc::new(Mutex::new(Streams::default()));
        let (job_tx, job_rx) = crossbeam_channel::bounded(bound);
        let (out_tx, out_rx) = crossbeam_channel::bounded(bound * config.replies_per_request.max(1));
        let text = TextThread {
            jobs: job_rx,
            replies: reply_rx,
            commands: cmd_tx,
            outputs: out_tx,
            wake,
            live: Arc::clone(&live),
            codec: Arc::clone(&codec),
            info: info.clone(),
            metrics: metrics.clone(),
            texts: Default::default(),
            backlog: Default::default(),
            compiler: crate::grammar::Compiler::start(Arc::new(grammars), GRAMMAR_THREADS, bound)?,
            compiling: HashMap::new(),
            compile_timeout: config.grammar_compile_timeout,
        };
        let text_thread = std::thread::Builder::new().name("engine-text".into()).spawn(move || text.run())?;
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        Ok(Engine {
            jobs: job_tx,
            outputs: out_rx,
            live,
            shared,
            codec,
            info,
            metrics,
            config,
            id_nonce: mix(nanos as u64 ^ (u64::from(std::process::id()) << 32)),
            next_id: 0,
            watchdog_ended: HashSet::new(),
            watchdog_order: VecDeque::new(),
            threads: vec![text_thread, engine_thread],
        })
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// The tokenizer and chat template.
    pub fn codec(&self) -> &TextCodec {
        &self.codec
    }

    /// The prompt's token ids as a request with `input` and `tools` would have them (chat template
    /// included), computed on the caller's thread.
    pub fn tokenize(
        &self,
        input: &Input,
        tools: &[pdserve_api::tools::Tool],
        chat_template_kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Vec<u32>, EngineError> {
        crate::chat::tokens(&self.codec, &self.info, input, tools, chat_template_kwargs)
    }

    /// The engine's metrics; a program may register its own beside them.
    pub fn registry(&self) -> &Registry {
        &self.metrics.registry
    }

    /// Live requests.
    pub fn len(&self) -> usize {
        lock(&self.live).streams.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `request_id` is live here.
    pub fn is_live(&self, request_id: &str) -> bool {
        lock(&self.live).by_request_id.contains_key(request_id)
    }

    /// Hands the request to the text thread, which tokenizes it and passes it on to the engine
    /// thread. What this call can tell at once (a duplicate id, the wrong role, a full queue) is its
    /// error; anything else (a prompt that does not fit the context, say) comes through
    /// [`poll`](Self::poll) as `Rejected`. Otherwise `Admitted` comes first.
    pub fn submit(&mut self, req: Request) -> Result<Id, EngineError> {
        if self.is_live(&req.request_id) {
            return Err(EngineError::DuplicateRequestId { request_id: req.request_id });
        }
        let remote = match (&req.input, self.info.role) {
            (Input::Remote(h), Role::Decode) => Some(Source {
                addr: h.addr,
                key: pdserve_pd_transfer::TransferKey { transfer: h.transfer, epoch: h.epoch },
                // A UCX decode engine reads a UCX sender's export; otherwise a same-host region file.
                region: h.ucx.clone().filter(|_| self.info.kv_ucx).or_else(|| h.shm.clone()),
            }),
            (Input::Remote(_), role) => {
                return Err(EngineError::InvalidInput {
                    problem: format!("a {role} engine computes its prompts; it takes no remote KV"),
                })
            }
            // A decode engine also computes a prompt itself (conditional disaggregation: the router
            // sends it a conversation's next round, whose history it holds).
            _ => None,
        };
        // A full queue answers at once, without a round trip to the engine thread.
        let queued = self.shared.queued.load(Ordering::Relaxed);
        let limit = self.config.scheduler.queued_requests_max;
        if queued >= limit {
            return Err(EngineError::QueueFull { queued, limit });
        }
        self.next_id += 1;
        let id = mix(self.id_nonce.wrapping_add(self.next_id));
        let sub = Submission {
            id,
            request_id: req.request_id.clone(),
            tokens: Vec::new(),
            remote,
            max_tokens: req.max_tokens,
            params: req.sampling,
            seed: req.seed.unwrap_or_else(|| mix(id ^ 0x5eed)),
            stop_ids: req.stop_token_ids,
            ignore_eos: req.ignore_eos,
            deadline: req.deadline,
            guide: None,
            min_tokens: req.min_tokens,
            logit_bias: req.logit_bias,
            resumed: req.resume,
            panic_in_sampling: req.test_panic == Some(crate::request::PanicSite::Sampling),
            priority: req.priority,
            trace_id: req.trace_id,
        };
        let tool_call_ids = req.tool_call_ids.unwrap_or_else(|| req.request_id.clone());
        // In the table before the text thread can answer for it.
        lock(&self.live).insert(id, Stream::new(req.request_id, req.deadline));
        let job = Job::Submit(Box::new(NewRequest {
            sub: Box::new(sub),
            input: req.input,
            tool_call_ids,
            tools: req.tools,
            tool_choice: req.tool_choice,
            parallel_tool_calls: req.parallel_tool_calls,
            chat_template_kwargs: req.chat_template_kwargs,
            reasoning: req.reasoning,
            constraint: req.constraint,
            stop: req.stop,
            include_stop: req.include_stop_str,
            logprobs: req.logprobs,
            panic_in_text: req.test_panic == Some(crate::request::PanicSite::Detokenizing),
        }));
        let error = match self.jobs.try_send(job) {
            Ok(()) => return Ok(Id(id)),
            Err(TrySendError::Full(_)) => EngineError::Busy { limit: self.jobs.capacity().unwrap_or(0) },
            Err(TrySendError::Disconnected(_)) => EngineError::Stopped,
        };
        lock(&self.live).remove(id);
        Err(error)
    }

    /// Ends a live request (it finishes as `Cancelled`). Idempotent.
    pub fn abort(&mut self, id: Id) -> bool {
        if !lock(&self.live).streams.contains_key(&id.0) {
            return false;
        }
        // A full queue loses the abort; the watchdog then ends the request at its deadline.
        let _ = self.jobs.try_send(Job::Command(Command::Abort(id.0)));
        true
    }

    /// Ends a request by its caller's name: a live one, or (prefill role) the offer of its KV.
    pub fn abort_request(&mut self, request_id: &str) -> Option<Aborted> {
        let live = lock(&self.live);
        if let Some(&id) = live.by_request_id.get(request_id) {
            drop(live);
            self.abort(Id(id));
            return Some(Aborted::InFlight(Id(id)));
        }
        // The newest, should a request id have been used again.
        let &(_, id) = live.recent_prefills.iter().rfind(|(r, _)| r == request_id)?;
        drop(live);
        let _ = self.jobs.try_send(Job::Command(Command::AbortTransfer(id)));
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
            queued: self.shared.queued.load(Ordering::Relaxed),
            running: self.shared.running.load(Ordering::Relaxed),
            transfers: self.shared.transfers.load(Ordering::Relaxed),
            oldest: lock(&self.live)
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

    /// Like [`poll`](Self::poll), but first waits up to `timeout` for an output (for a program
    /// without an event loop of its own).
    pub fn poll_timeout(&mut self, timeout: Duration, out: &mut Vec<Output>) {
        let wait = timeout.min(self.next_watchdog(Instant::now()));
        if let Ok(o) = self.outputs.recv_timeout(wait) {
            self.take(o, out);
        }
        self.poll(Instant::now(), out);
    }

    /// Appends what happened since the last call to `out`, and ends (as timed out) requests left past
    /// their deadline plus the grace.
    pub fn poll(&mut self, now: Instant, out: &mut Vec<Output>) {
        while let Ok(o) = self.outputs.try_recv() {
            self.take(o, out);
        }
        self.watchdog(now, out);
    }

    /// Passes `o` on, unless the watchdog has already ended its request (text the text thread made
    /// just before would otherwise come after the end).
    fn take(&mut self, o: Output, out: &mut Vec<Output>) {
        if !self.watchdog_ended.contains(&o.id().0) {
            out.push(o);
        }
    }

    fn next_watchdog(&self, now: Instant) -> Duration {
        lock(&self.live)
            .streams
            .values()
            .map(|s| (s.deadline + self.config.watchdog_grace).saturating_duration_since(now))
            .min()
            .unwrap_or(Duration::MAX)
    }

    /// Ends requests not ended by their deadline plus a grace period (a stuck engine or text thread):
    /// the caller gets the end, the engine thread an abort.
    fn watchdog(&mut self, now: Instant, out: &mut Vec<Output>) {
        let grace = self.config.watchdog_grace;
        let mut live = lock(&self.live);
        let overdue: Vec<u64> =
            live.streams.iter().filter(|(_, s)| now > s.deadline + grace).map(|(&id, _)| id).collect();
        let ended: Vec<(u64, Stream)> =
            overdue.into_iter().filter_map(|id| Some((id, live.remove(id)?))).collect();
        drop(live);
        for (id, s) in ended {
            if self.watchdog_ended.len() >= WATCHDOG_ENDED_MAX {
                if let Some(old) = self.watchdog_order.pop_front() {
                    self.watchdog_ended.remove(&old);
                }
            }
            self.watchdog_ended.insert(id);
            self.watchdog_order.push_back(id);
            let _ = self.jobs.try_send(Job::Command(Command::Abort(id)));
            // The stage the engine last recorded for it (queued if it never got that far).
            let stage =
                self.shared.ledger().get(&s.request_id).map_or(Stage::queued(self.info.role), |e| e.stage);
            let timings = timings(&s, Times::default(), now);
            out.push(Output::Finished {
                id: Id(id),
                finish: Finish::TimedOut { stage },
                usage: s.usage(),
                timings,
            });
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Closing the job channel ends the text thread, which closes the engine thread's commands;
        // the output channel is closed first, so nothing waits for outputs to be taken.
        let (_, rx) = crossbeam_channel::bounded(1);
        drop(std::mem::replace(&mut self.outputs, rx));
        let (tx, _) = crossbeam_channel::bounded(1);
        drop(std::mem::replace(&mut self.jobs, tx));
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A one-group model's KV as a KV group: every layer keeps a row per token (its K and V, or a
/// latent-attention model's latent row), over a sliding window where the model has one.
fn kv_group(
    model: &pdserve_model::ModelConfig,
    bytes_per_token: usize,
    blocks: usize,
    compact: bool,
) -> pdserve_kvcache::GroupSpec {
    use pdserve_kvcache::{GroupSpec, LayerKind};
    let layers = if compact { 1 } else { (model.num_layers + model.draft_layers).max(1) };
    let (name, kind) = match (model.mla.is_some(), model.sliding_window) {
        // DeepSeek V4's compact layout: every layer's compressed rows of a block together (the
        // windows and partial groups are in the request's state).
        _ if compact => ("v4-compressed", LayerKind::Full),
        (true, _) => ("latent", LayerKind::Full),
        (false, Some(w)) => ("window", LayerKind::Sliding { window: w as u32 }),
        (false, None) => ("full", LayerKind::Full),
    };
    GroupSpec {
        name: name.into(),
        kind,
        layers: layers as u32,
        row_bytes: (bytes_per_token / layers) as u32,
        num_blocks: blocks as u32,
    }
}
