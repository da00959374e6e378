//! The engine thread: the I/O around [`EngineCore`]. It owns the clock, the command and reply
//! channels, the model backend (a long step runs on a thread of its own while aborts are served) and
//! the KV transfer endpoint (pumped between steps, never waited on longer than a millisecond while
//! commands may come). [`Worker`] is its work without threads or a clock, which a simulation drives
//! on a virtual one.

use std::collections::{HashMap, HashSet};
use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, SendTimeoutError, Sender};
use pdserve_kvcache::{BlockCopy, BlockId, OwnerKind};
use pdserve_model::{Backend, KvLayout, ModelError, SeqStep};
use pdserve_pd_transfer::{BlockMemory, Endpoint, EndpointStats, TransferError};
use pdserve_telemetry::RequestLedger;

use crate::core::{
    CoreStats, EngineCore, Reply, StepDone, StepFailure, StepOutput, StepPlan, Submission, TransferCall,
};
use crate::metrics::Metrics;

/// What the text thread asks of the engine thread, in order.
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

/// What the handle can read of the engine thread without asking it.
#[derive(Debug)]
pub(crate) struct Shared {
    pub epoch: Instant,
    /// Milliseconds since `epoch` of the last loop iteration.
    pub last_tick_ms: AtomicU64,
    /// Milliseconds since `epoch` of the last token sampled (0: never).
    pub last_token_ms: AtomicU64,
    pub queued: AtomicUsize,
    pub running: AtomicUsize,
    /// KV transfers offered or being pulled.
    pub transfers: AtomicUsize,
    pub ledger: Mutex<RequestLedger>,
}

impl Shared {
    pub(crate) fn new(epoch: Instant, ledger: RequestLedger) -> Shared {
        Shared {
            epoch,
            last_tick_ms: Default::default(),
            last_token_ms: Default::default(),
            queued: Default::default(),
            running: Default::default(),
            transfers: Default::default(),
            ledger: Mutex::new(ledger),
        }
    }

    pub(crate) fn ms_since_epoch(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_millis() as u64
    }

    pub(crate) fn ledger(&self) -> std::sync::MutexGuard<'_, RequestLedger> {
        // The ledger holds plain data; one poisoned by a panic elsewhere is still consistent.
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The test hook `EngineConfig::test_corrupt_kv_pull`: pulls started, the one whose first received
/// block to corrupt, and whether that block is still to come.
#[derive(Debug, Default)]
struct TestCorruption {
    pulls: u32,
    target: u32,
    armed: bool,
}

/// The backend's KV memory, as the transfer endpoint reads and writes it (with the test hook).
struct Memory<'a>(&'a mut dyn Backend, &'a mut TestCorruption);

impl Memory<'_> {
    /// `data`, or (the test hook's block) a copy with one bit flipped.
    fn received<'d>(&mut self, data: &'d [u8]) -> std::borrow::Cow<'d, [u8]> {
        if !self.1.armed || data.is_empty() {
            return std::borrow::Cow::Borrowed(data);
        }
        self.1.armed = false;
        let mut bad = data.to_vec();
        bad[data.len() / 2] ^= 0x10;
        std::borrow::Cow::Owned(bad)
    }
}

impl BlockMemory for Memory<'_> {
    fn read_block(&self, block: BlockId, out: &mut [u8]) -> Result<(), TransferError> {
        self.0.read_block(block, out).map_err(|_| TransferError::BlockIo { block })
    }
    fn write_block(&mut self, block: BlockId, data: &[u8]) -> Result<(), TransferError> {
        let data = self.received(data);
        self.0.write_block(block, &data).map_err(|_| TransferError::BlockIo { block })
    }
    fn block(&self, block: BlockId, len: usize) -> Option<&[u8]> {
        self.0.block_bytes(block).filter(|b| b.len() == len)
    }
    fn write_block_striped(&mut self, block: BlockId, data: &[u8]) -> Result<u32, TransferError> {
        let data = self.received(data);
        match self.0.block_bytes_mut(block).filter(|b| b.len() == data.len()) {
            Some(dst) => Ok(pdserve_pd_transfer::copy_striped(dst, &data)),
            None => {
                let digest = pdserve_pd_transfer::striped(&data);
                self.0.write_block(block, &data).map_err(|_| TransferError::BlockIo { block })?;
                Ok(digest)
            }
        }
    }
}

/// The core, the model backend and the transfer endpoint joined: what the engine thread does each
/// turn, without threads or a clock of its own.
pub struct Worker {
    core: EngineCore,
    backend: Box<dyn Backend>,
    endpoint: Option<Endpoint>,
    /// The KV offload tier's memory, when the engine has one.
    offload: Option<crate::offload::OffloadStore>,
    /// The test hook (`EngineConfig::test_corrupt_kv_pull`).
    corrupt: TestCorruption,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("core", &self.core).field("endpoint", &self.endpoint).finish()
    }
}

/// What a transfer call gets on a worker without an endpoint (a unified one, which makes none).
fn no_endpoint() -> TransferError {
    let error = io::Error::new(io::ErrorKind::NotConnected, "this worker has no KV transfer endpoint");
    TransferError::Connect { addr: std::net::SocketAddr::from(([0, 0, 0, 0], 0)), error }
}

impl Worker {
    pub fn new(core: EngineCore, backend: Box<dyn Backend>, endpoint: Option<Endpoint>) -> Worker {
        Worker { core, backend, endpoint, offload: None, corrupt: TestCorruption::default() }
    }

    /// With the KV offload tier's memory (the core's KV cache has the tier of its size).
    pub(crate) fn with_offload(mut self, store: Option<crate::offload::OffloadStore>) -> Worker {
        self.offload = store;
        self
    }

    /// With the test hook: the first block received after the `n`th pull starts (from 1; 0: none)
    /// gets one bit flipped.
    pub fn with_test_corruption(mut self, n: u32) -> Worker {
        self.corrupt.target = n;
        self
    }

    pub fn core(&self) -> &EngineCore {
        &self.core
    }

    /// The core, for its inputs; follow each with [`transfer_calls`](Self::transfer_calls).
    pub fn core_mut(&mut self) -> &mut EngineCore {
        &mut self.core
    }

    pub fn endpoint(&self) -> Option<&Endpoint> {
        self.endpoint.as_ref()
    }

    /// Whether the endpoint holds live transfers.
    pub fn transfers_live(&self) -> bool {
        self.endpoint.as_ref().is_some_and(|e| !e.is_empty())
    }

    /// Performs the core's transfer calls in order, answering each.
    pub fn transfer_calls(&mut self, now: Instant) {
        while let Some(call) = self.core.poll_transfer() {
            let Some(ep) = self.endpoint.as_mut() else {
                match call {
                    TransferCall::Offer { transfer, .. } => {
                        self.core.handle_offered(now, transfer.0, Err(no_endpoint()))
                    }
                    TransferCall::Pull { source, .. } => {
                        self.core.handle_pull_started(now, source.key.transfer, Err(no_endpoint()))
                    }
                    TransferCall::SetDestination { transfer, .. } => {
                        self.core.handle_destination_set(now, transfer, Err(no_endpoint()))
                    }
                    TransferCall::Abort { .. } => {}
                }
                continue;
            };
            match call {
                TransferCall::Offer { transfer, blocks, expires_at_ms, meta, now_ms } => {
                    let r = ep.offer(transfer, blocks, expires_at_ms, meta, now_ms);
                    self.core.handle_offered(now, transfer.0, r);
                }
                TransferCall::Pull { source, deadline_ms, now_ms } => {
                    self.corrupt.pulls += 1;
                    self.corrupt.armed |= self.corrupt.pulls == self.corrupt.target;
                    let r = ep.pull(&source, deadline_ms, now_ms);
                    self.core.handle_pull_started(now, source.key.transfer, r);
                }
                TransferCall::SetDestination { transfer, from, dest } => {
                    let r = ep.set_destination(transfer, from, dest);
                    self.core.handle_destination_set(now, transfer, r);
                }
                TransferCall::Abort { transfer } => {
                    ep.abort(transfer);
                }
            }
        }
    }

    /// Moves transfer frames and block bytes at `now`, and hands the endpoint's events to the core.
    pub fn pump(&mut self, now: Instant) -> io::Result<()> {
        self.pump_waiting(now, Duration::ZERO, || now)
    }

    /// [`pump`](Self::pump), first waiting up to `wait` for transfer I/O; `after` tells the time once
    /// the wait is over (what arrived, arrived then).
    pub fn pump_waiting(
        &mut self,
        now: Instant,
        wait: Duration,
        after: impl FnOnce() -> Instant,
    ) -> io::Result<()> {
        let Some(ep) = self.endpoint.as_mut() else { return Ok(()) };
        let now_ms = self.core.now_ms(now);
        let ledger = crate::ledger::StateLedger(self.core.kv(), self.backend.kv_state());
        let memory = &mut Memory(self.backend.as_mut(), &mut self.corrupt);
        let pumped = ep.pump(&ledger, memory, now_ms, wait);
        let now = after();
        while let Some(e) = self.endpoint.as_mut().and_then(Endpoint::poll_event) {
            self.core.handle_transfer_event(now, e);
            self.transfer_calls(now);
        }
        pumped
    }

    /// Plans a step and runs it on this thread; false when there was nothing to step.
    pub fn step(&mut self, now: Instant) -> bool {
        let Some(mut plan) = self.core.poll_step(now, self.transfers_live()) else { return false };
        plan.guides.compute();
        let output = run_plan(self.backend.as_mut(), self.offload.as_mut(), &plan);
        self.core.handle_step_done(now, StepDone::new(output, plan.guides));
        draft_pass(&mut self.core, self.backend.as_mut());
        self.transfer_calls(now);
        true
    }
}

/// The draft pass the core planned after the step just answered (the model's draft layer), run
/// before anything else reads or writes the KV memory; a panic in it is caught.
fn draft_pass(core: &mut EngineCore, backend: &mut dyn Backend) {
    if let Some(plan) = core.take_draft_plan() {
        let out = catch_unwind(AssertUnwindSafe(|| backend.draft(&plan.draft_steps())))
            .unwrap_or_else(|_| Err(ModelError::InvalidInput { problem: "the draft pass panicked".into() }));
        if let Err(e) = core.handle_drafts(plan, out) {
            eprintln!("engine: draft pass failed (no drafts for its requests this step): {e}");
        }
    }
}

/// The plan's copies to and from the offload tier and its block copies, then its forward pass, a panic
/// in the pass caught.
fn run_plan(
    backend: &mut dyn Backend,
    offload: Option<&mut crate::offload::OffloadStore>,
    plan: &StepPlan,
) -> Result<StepOutput, StepFailure> {
    if let Some(store) = offload {
        match catch_unwind(AssertUnwindSafe(|| store.apply(backend, &plan.tier_copies))) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(StepFailure::Offload(e.to_string())),
            Err(_) => return Err(StepFailure::Offload("a copy panicked".into())),
        }
    }
    backend.copy_blocks(&plan.copies).map_err(StepFailure::Model)?;
    forward(backend, &plan.seq_steps(), plan.picks_only)
}

/// The forward pass, greedy picks only when `picks`; a panic is caught.
fn forward(backend: &mut dyn Backend, steps: &[SeqStep<'_>], picks: bool) -> Result<StepOutput, StepFailure> {
    let r = catch_unwind(AssertUnwindSafe(|| {
        if picks {
            backend.forward_greedy(steps).map(StepOutput::Picks)
        } else {
            backend.forward(steps).map(StepOutput::Logits)
        }
    }));
    match r {
        Ok(Ok(o)) => Ok(o),
        Ok(Err(e)) => Err(StepFailure::Model(e)),
        Err(_) => Err(StepFailure::Panicked),
    }
}

/// Steps of at least this many tokens run on their own thread while the engine thread serves
/// aborts; shorter ones (a few decoding sequences, a few milliseconds) run on the engine thread.
const SERVED_STEP_TOKENS: usize = 8;

/// The engine thread. See the [module docs](self).
pub(crate) struct EngineThread {
    pub worker: Worker,
    pub commands: Receiver<Command>,
    pub replies: Sender<Vec<Reply>>,
    pub shared: Arc<Shared>,
    pub metrics: Metrics,
    /// Whether long steps run on a thread of their own while aborts are served (CPU backends).
    pub step_thread: bool,
    /// Replies of this turn, sent together at its end.
    outbox: Vec<Reply>,
    /// The ledger's entries, by the core's id.
    published: HashMap<u64, String>,
    /// What the metrics have been told of the core's and the endpoint's totals.
    told: CoreStats,
    told_transfers: EndpointStats,
    told_preemptions: u64,
    /// Where the prefix cache's changes go (`EngineConfig::kv_events`).
    kv_events: Option<pdserve_kv_events::Publisher>,
    /// The KV cache's dropped changes, as last seen.
    kv_events_dropped: u64,
    /// A batch was dropped for a full queue: `AllBlocksCleared` is owed.
    kv_events_lost: bool,
}

/// Prefix-cache changes the KV cache keeps between two turns of the engine thread at most (a turn
/// stores a step's blocks: thousands at most).
pub(crate) const KV_EVENTS_PER_TURN_MAX: usize = 1 << 20;

impl EngineThread {
    pub(crate) fn new(
        worker: Worker,
        commands: Receiver<Command>,
        replies: Sender<Vec<Reply>>,
        shared: Arc<Shared>,
        metrics: Metrics,
        step_thread: bool,
    ) -> EngineThread {
        EngineThread {
            worker,
            commands,
            replies,
            shared,
            metrics,
            step_thread,
            outbox: Vec::new(),
            published: HashMap::new(),
            told: CoreStats::default(),
            told_transfers: EndpointStats::default(),
            told_preemptions: 0,
            kv_events: None,
            kv_events_dropped: 0,
            kv_events_lost: false,
        }
    }

    /// Publishes the prefix cache's changes through `p`, starting with `AllBlocksCleared` (a
    /// subscriber that knew this worker's earlier process forgets its blocks).
    pub(crate) fn with_kv_events(mut self, p: pdserve_kv_events::Publisher) -> EngineThread {
        self.worker.core.record_kv_events(KV_EVENTS_PER_TURN_MAX);
        p.publish(vec![pdserve_kv_events::KvEvent::AllBlocksCleared]);
        self.kv_events = Some(p);
        self
    }

    /// The turn's prefix-cache changes as one batch of vLLM's events.
    fn publish_kv_events(&mut self) {
        let Some(p) = self.kv_events.as_ref() else { return };
        let changes = self.worker.core.take_kv_events();
        let dropped = self.worker.core.kv_events_dropped();
        if dropped > self.kv_events_dropped || self.kv_events_lost {
            // Some changes were lost (the cache's record of them overflowed, or a batch found the
            // publisher's queue full, which costs no sequence number a subscriber could miss):
            // subscribers forget this worker's blocks rather than drift, until this is taken.
            self.kv_events_dropped = dropped;
            self.kv_events_lost = !p.publish(vec![pdserve_kv_events::KvEvent::AllBlocksCleared]);
        } else if !changes.is_empty() {
            let block_size = self.worker.core.kv().block_size() as u32;
            let events = changes
                .into_iter()
                .map(|c| match c {
                    pdserve_kvcache::CacheEvent::Stored { hash, parent, tokens, medium } => {
                        pdserve_kv_events::KvEvent::BlockStored {
                            block_hashes: vec![hash],
                            parent_block_hash: parent,
                            token_ids: tokens,
                            block_size,
                            medium: medium.as_str(),
                        }
                    }
                    pdserve_kvcache::CacheEvent::Removed { hash, medium } => {
                        pdserve_kv_events::KvEvent::BlockRemoved {
                            block_hashes: vec![hash],
                            medium: medium.as_str(),
                        }
                    }
                })
                .collect();
            self.kv_events_lost = !p.publish(pdserve_kv_events::coalesce(events));
        }
        let st = p.stats();
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        for (result, total) in [
            ("published", load(&st.batches_published)),
            ("dropped", load(&st.batches_dropped)),
            ("subscriber_dropped", load(&st.subscriber_batches_dropped)),
        ] {
            if let Ok(c) = self.metrics.kv_event_batches.with(&[result]) {
                c.add(total.saturating_sub(c.get()));
            }
        }
        self.metrics.kv_event_subscribers.set(st.subscribers.load(Ordering::Relaxed) as f64);
    }

    /// Runs until the text thread drops its command sender.
    pub(crate) fn run(mut self) {
        loop {
            let now = Instant::now();
            self.shared.last_tick_ms.store(self.shared.ms_since_epoch(now), Ordering::Relaxed);
            // Block briefly when idle; otherwise take what is queued and go on stepping. Transfers are
            // pumped between waits: often while one is live (a new one starts from a command, which
            // ends the wait at once).
            let idle = self.worker.core.is_idle();
            if self.worker.transfers_live() && idle {
                // Nothing to step but a transfer: wait on its sockets rather than on the command
                // channel, so each of its round trips goes on the moment the other worker's frame
                // arrives (a command waits a millisecond at most).
                self.pump(now, Duration::from_millis(1));
            } else {
                let wait = if idle { Duration::from_millis(50) } else { Duration::ZERO };
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
            self.pump(Instant::now(), Duration::ZERO);
            // Admissions and refusals go out before the step (which may take a while), its tokens
            // after it.
            self.flush();
            self.step();
            self.publish();
            self.flush();
        }
    }

    fn pump(&mut self, before: Instant, wait: Duration) {
        if let Err(e) = self.worker.pump_waiting(before, wait, Instant::now) {
            eprintln!("engine: KV transfer poll failed: {e}");
        }
        self.collect();
    }

    fn command(&mut self, cmd: Command) {
        let now = Instant::now();
        let core = &mut self.worker.core;
        match cmd {
            Command::Submit(s) => core.handle_submit(now, s),
            Command::Abort(id) => core.handle_abort(now, id),
            Command::Fail { id, reason } => core.handle_fail(now, id, reason),
            Command::AbortTransfer(t) => core.handle_abort_transfer(t),
        }
        self.worker.transfer_calls(now);
        self.collect();
    }

    /// Takes the core's replies into this turn's outbox; an ended request leaves the ledger at once
    /// (its other entries are kept up to date once a turn, by [`publish`](Self::publish)).
    fn collect(&mut self) {
        while let Some(r) = self.worker.core.poll_reply() {
            if r.is_end() {
                if let Some(request_id) = self.published.remove(&r.id()) {
                    self.shared.ledger().finish(&request_id);
                }
            }
            self.outbox.push(r);
        }
    }

    /// Sends the turn's replies, so a step's tokens cost the text thread one wake-up, not one per
    /// sequence.
    fn flush(&mut self) {
        self.collect();
        if self.outbox.is_empty() {
            return;
        }
        let out = std::mem::take(&mut self.outbox);
        // The text thread drains this channel as replies come and never waits on the caller; a full
        // channel for seconds means it is stuck, and then dropping the replies is the lesser evil: the
        // handle's watchdog ends their requests at their deadlines, and the log names them.
        match self.replies.send_timeout(out, Duration::from_secs(5)) {
            Ok(()) | Err(SendTimeoutError::Disconnected(_)) => {} // shutting down
            Err(SendTimeoutError::Timeout(r)) => {
                eprintln!(
                    "engine: replies dropped, the text thread did not drain its channel for 5 s: {r:?}"
                );
            }
        }
    }

    fn step(&mut self) {
        let now = Instant::now();
        let live = self.worker.transfers_live();
        let Some(mut plan) = self.worker.core.poll_step(now, live) else {
            self.collect();
            return;
        };
        // Gauges show the step's reservations while it runs, not only after it.
        self.publish();
        let tokens_before = self.worker.core.stats().tokens_generated_total;
        let served = self.step_thread && plan.tokens() >= SERVED_STEP_TOKENS;
        // The token masks of constrained requests are computed on a second thread while the forward
        // pass runs: they depend only on the tokens so far.
        let guides = std::mem::take(&mut plan.guides);
        let (output, guides) = std::thread::scope(|scope| {
            let masker = (!guides.is_empty()).then(|| {
                scope.spawn(move || {
                    let mut g = guides;
                    g.compute();
                    g
                })
            });
            let output = if served {
                self.run_serving_aborts(&plan)
            } else {
                run_plan(self.worker.backend.as_mut(), self.worker.offload.as_mut(), &plan)
            };
            (output, masker.map(|m| m.join().unwrap_or_default()).unwrap_or_default())
        });
        let done = Instant::now();
        self.metrics.step.record(done.saturating_duration_since(now));
        self.worker.core.handle_step_done(done, StepDone::new(output, guides));
        draft_pass(&mut self.worker.core, self.worker.backend.as_mut());
        self.worker.transfer_calls(done);
        self.collect();
        if self.worker.core.stats().tokens_generated_total > tokens_before {
            self.shared.last_token_ms.store(self.shared.ms_since_epoch(Instant::now()), Ordering::Relaxed);
        }
    }

    /// Runs the plan on a thread of its own. Meanwhile an abort takes effect at once: the request
    /// ends, is no longer listed, and its blocks go back to the pool. The step's arithmetic for it
    /// goes on and is dropped; nothing can be given those blocks before the step ends, since only
    /// the core allocates, and not while a step is in flight. Other commands wait inside the core
    /// for the step's end, in order.
    fn run_serving_aborts(&mut self, plan: &StepPlan) -> Result<StepOutput, StepFailure> {
        let layout = self.worker.backend.kv_layout();
        let mut backend = std::mem::replace(&mut self.worker.backend, Box::new(Stepping(layout)));
        let mut offload = self.worker.offload.take();
        let (done, finished) = crossbeam_channel::bounded::<()>(1);
        let (output, backend, offload) = std::thread::scope(|scope| {
            let stepper = scope.spawn(move || {
                let r = run_plan(backend.as_mut(), offload.as_mut(), plan);
                drop(done);
                (r, backend, offload)
            });
            self.serve_commands(&finished);
            stepper.join().expect("the step's panic is caught on its thread")
        });
        self.worker.backend = backend;
        self.worker.offload = offload;
        output
    }

    /// Takes commands until `finished` closes (the core keeps all but aborts for the step's end),
    /// until the core holds as many as it should; then it waits for the step alone.
    fn serve_commands(&mut self, finished: &Receiver<()>) {
        loop {
            if self.worker.core.deferred_full() {
                let _ = finished.recv();
                return;
            }
            crossbeam_channel::select! {
                recv(finished) -> _ => return,
                recv(self.commands) -> cmd => match cmd {
                    Ok(c) => {
                        self.command(c);
                        self.flush();
                    }
                    Err(_) => {
                        let _ = finished.recv();
                        return;
                    }
                },
            }
        }
    }

    /// The ledger's stages and counts, the gauges, and the counters the core and the endpoint keep.
    fn publish(&mut self) {
        let now = Instant::now();
        let core = &self.worker.core;
        {
            let mut ledger = self.shared.ledger();
            let mut seen = HashSet::with_capacity(self.published.len());
            for v in core.requests() {
                seen.insert(v.id);
                if let std::collections::hash_map::Entry::Vacant(e) = self.published.entry(v.id) {
                    let _ = ledger.admit(v.request_id, v.stage, v.submitted, v.deadline, "engine");
                    if let Some(t) = v.trace_id {
                        let _ = ledger.set_trace(v.request_id, t);
                    }
                    e.insert(v.request_id.to_owned());
                }
                let _ = ledger.set_stage(v.request_id, v.stage, now);
                let _ = ledger.set_waiting(v.request_id, v.waiting_for);
                let _ = ledger.set_counts(
                    v.request_id,
                    v.tokens_in as u32,
                    v.tokens_out as u32,
                    v.kv_blocks as u32,
                );
            }
            self.published.retain(|id, request_id| {
                let live = seen.contains(id);
                if !live {
                    ledger.finish(request_id);
                }
                live
            });
        }
        let st = core.scheduler_stats();
        self.shared.queued.store(core.queued(), Ordering::Relaxed);
        self.shared.running.store(core.running(), Ordering::Relaxed);
        self.metrics.queued.set(st.queued as f64);
        self.metrics.running.set(st.running as f64);
        let kv = core.kv().stats();
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
        self.metrics.preemptions.add(st.preemptions_total.saturating_sub(self.told_preemptions));
        self.told_preemptions = st.preemptions_total;
        // Counters mirror the scheduler's and the cache's own totals.
        for (result, total) in [("hit", st.prefix_hit_tokens_total), ("miss", st.prefix_miss_tokens_total)] {
            if let Ok(c) = self.metrics.prefix_tokens.with(&[result]) {
                c.add(total.saturating_sub(c.get()));
            }
        }
        self.metrics
            .evicted_blocks
            .add(kv.evicted_blocks_total.saturating_sub(self.metrics.evicted_blocks.get()));
        crate::ledger::publish_states(core.kv(), &self.metrics);
        let t = core.kv().tier_stats();
        if t.host_blocks_total + t.disk_blocks_total > 0 {
            for (medium, used, total) in [
                ("host", t.host_blocks_used, t.host_blocks_total),
                ("disk", t.disk_blocks_used, t.disk_blocks_total),
            ] {
                for (state, v) in [("used", used), ("total", total)] {
                    if let Ok(g) = self.metrics.offload_blocks.with(&[medium, state]) {
                        g.set(v as f64);
                    }
                }
            }
            for (mv, total) in [
                ("offloaded", t.offloaded_blocks_total),
                ("demoted", t.demoted_blocks_total),
                ("restored", t.restored_blocks_total),
                ("dropped", t.dropped_blocks_total),
            ] {
                if let Ok(c) = self.metrics.offload_moves.with(&[mv]) {
                    c.add(total.saturating_sub(c.get()));
                }
            }
        }
        self.tell_core_stats();
        self.publish_kv_events();
        if let Some(ep) = self.worker.endpoint.as_ref() {
            self.shared.transfers.store(ep.len(), Ordering::Relaxed);
            self.metrics.transfers_in_flight.set(ep.len() as f64);
            let s = ep.stats();
            let last = std::mem::replace(&mut self.told_transfers, s);
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

    /// Adds what the core's totals grew by since they were last told to the metrics.
    fn tell_core_stats(&mut self) {
        let (waits, transfers) = self.worker.core.take_samples();
        for w in waits {
            self.metrics.queue_wait.record(w);
        }
        for ms in transfers {
            self.metrics.transfer_time.record(Duration::from_millis(ms));
        }
        let s = self.worker.core.stats();
        let m = &self.metrics;
        let t = &self.told;
        m.tokens_prompt.add(s.tokens_prompt_total - t.tokens_prompt_total);
        m.tokens_generated.add(s.tokens_generated_total - t.tokens_generated_total);
        m.greedy_steps.add(s.greedy_steps_total - t.greedy_steps_total);
        m.draft_tokens.add(s.draft_tokens_total - t.draft_tokens_total);
        m.draft_accepted.add(s.draft_accepted_total - t.draft_accepted_total);
        for (reason, &n) in &s.rejected_total {
            let before = t.rejected_total.get(reason).copied().unwrap_or(0);
            if let Ok(c) = m.rejected.with(&[reason]) {
                c.add(n - before);
            }
        }
        for (&(outcome, stage), &n) in &s.finished_total {
            let before = t.finished_total.get(&(outcome, stage)).copied().unwrap_or(0);
            if let Ok(c) = m.finished.with(&[outcome.as_str(), stage.as_str()]) {
                c.add(n - before);
            }
        }
        for (&(side, result), &n) in &s.transfers_finished_total {
            let before = t.transfers_finished_total.get(&(side, result)).copied().unwrap_or(0);
            if let Ok(c) = m.transfers_finished.with(&[side, result]) {
                c.add(n - before);
            }
        }
        for (result, n, before) in [
            ("skipped", s.transfer_blocks_skipped_total, t.transfer_blocks_skipped_total),
            ("transferred", s.transfer_blocks_transferred_total, t.transfer_blocks_transferred_total),
        ] {
            if let Ok(c) = m.transfer_blocks.with(&[result]) {
                c.add(n - before);
            }
        }
        self.told = s.clone();
    }
}

/// Stands in for the backend while a step runs on its own thread; nothing uses it then (aborts
/// touch only the core and the transfer endpoint), and anything that did would get an error, not a
/// race.
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
