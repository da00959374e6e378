//! The engine thread: it owns the scheduler (and with it the KV cache), the model backend and every
//! request's sampler. It talks to the HTTP thread only through two bounded channels.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use pdserve_api::Stage as LedgerStage;
use pdserve_kvcache::{OwnerKind, SeqId, TransferId};
use pdserve_model::{Backend, Sampler, SamplingParams, SeqStep};
use pdserve_pd_transfer::{Layout, Message, Outcome as TransferOutcome, PeerId, SendAction, TransferKey};
use pdserve_scheduler::{
    Event, KvSource, NewRequest, Outcome, Rejection, RequestId, Sampled, Scheduler, Stage,
};
use pdserve_telemetry::RequestLedger;

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
    /// Decode role: where the prompt's KV comes from.
    pub remote: Option<RemoteKv>,
}

/// A prefill worker's handle on a prompt's KV, as the decode side uses it.
#[derive(Debug, Clone)]
pub(crate) struct RemoteKv {
    pub key: TransferKey,
    pub addr: std::net::SocketAddr,
    pub first_token: u32,
    /// The prefill worker's shared KV file, if it has one on this host.
    pub shm: Option<std::path::PathBuf>,
}

#[derive(Debug)]
pub(crate) enum Command {
    Submit(Box<Submission>),
    Abort(u64),
    /// Prefill role: end the offer of a finished prompt's KV (its transfer id is the request's id).
    AbortTransfer(u64),
}

/// What the engine tells the HTTP thread, in order per request: `Admitted` or `Rejected`, then
/// `Token`s, then exactly one `Finished`.
#[derive(Debug)]
pub(crate) enum Reply {
    Admitted(u64),
    Rejected(u64, Rejection),
    Token {
        id: u64,
        token: u32,
        logprob: f32,
        top: Vec<(u32, f32)>,
        stop: bool,
    },
    Finished {
        id: u64,
        outcome: Outcome,
        output_tokens: usize,
        times: Times,
    },
    /// Prefill role: the prompt is done; its KV waits under `key` for the decode worker.
    Prefilled {
        id: u64,
        first_token: u32,
        key: TransferKey,
        blocks: usize,
        times: Times,
    },
}

/// When a request reached the engine's milestones, for the per-stage timings answers carry.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Times {
    /// First scheduled into a batch.
    pub scheduled: Option<Instant>,
    /// Decode role: the prompt's KV arrived from the prefill worker.
    pub kv_arrived: Option<Instant>,
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
    times: Times,
}

/// The PD transfer state of a prefill or decode worker.
pub(crate) struct Pd {
    pub io: crate::transfer::TransferIo,
    pub sender: pdserve_pd_transfer::Sender,
    pub receiver: pdserve_pd_transfer::Receiver,
    pub layout: Layout,
    pub next_epoch: u32,
    /// Decode role: transfer id -> (request id, connection, shared KV file when reading from one).
    pub incoming: HashMap<u64, (u64, PeerId, Option<std::path::PathBuf>)>,
    /// When each live transfer began (offer or pull), for the latency histogram.
    pub started: HashMap<(bool, u64), Instant>,
    /// Decode role: prefill workers' shared KV files, mapped once each.
    pub views: HashMap<std::path::PathBuf, pdserve_model::SharedKvView>,
}

pub(crate) struct Engine {
    pub sched: Scheduler,
    pub pd: Option<Pd>,
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
            // Transfer sockets are pumped between waits: poll them often only while a transfer is live
            // (new ones start from a command, which ends the wait at once).
            let transfers =
                self.pd.as_ref().is_some_and(|pd| !pd.sender.is_empty() || !pd.receiver.is_empty());
            let wait = match (transfers, self.sched.is_empty()) {
                (_, false) => Duration::ZERO,
                (true, true) => Duration::from_millis(2),
                (false, true) => Duration::from_millis(50),
            };
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
            self.pump_transfers(&mut live);
            self.step(&mut live);
            self.publish(&live);
        }
    }

    fn send(&self, r: Reply) {
        // The HTTP thread drains this channel every turn; a full channel for seconds means it is stuck,
        // and then dropping the reply is the lesser evil (its watchdog ends the request at its deadline).
        if let Err(e) = self.replies.send_timeout(r, Duration::from_secs(5)) {
            // Not silent: the log names the request; its client is answered by the HTTP thread's
            // watchdog at the request's deadline.
            eprintln!(
                "engine: reply dropped, the HTTP thread did not drain its channel for 5 s: {:?}",
                e.into_inner()
            );
        }
        let _ = self.waker.wake();
    }

    fn command(&mut self, cmd: Command, live: &mut HashMap<u64, Live>) {
        let now = Instant::now();
        match cmd {
            Command::Submit(s) => {
                let kv = match &s.remote {
                    Some(r) => {
                        KvSource::Remote { transfer: TransferId(r.key.transfer), first_token: r.first_token }
                    }
                    None => KvSource::Compute,
                };
                let req = NewRequest {
                    id: RequestId(s.id),
                    prompt: s.tokens.clone(),
                    max_tokens: s.max_tokens,
                    queue_deadline: s.deadline,
                    deadline: s.deadline,
                    kv,
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
                                times: Times::default(),
                            },
                        );
                        self.send(Reply::Admitted(s.id));
                        if let Some(r) = &s.remote {
                            self.start_pull(s.id, r, s.deadline, now);
                        }
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
                // A prefill request may have finished already, its KV offered under the same id: the
                // abort ends the offer too, instead of leaving it to the lease expiry.
                if let Some(pd) = self.pd.as_mut() {
                    pd.sender.abort(id);
                }
                self.drain_events(live);
            }
            Command::AbortTransfer(t) => {
                // The sender tells a pulling peer and reports the end; `pump_transfers` then releases
                // the lease. Idempotent: an ended transfer is left alone.
                if let Some(pd) = self.pd.as_mut() {
                    pd.sender.abort(t);
                }
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
                if l.times.scheduled.is_none() {
                    l.times.scheduled = Some(now);
                    self.metrics.queue_wait.observe_duration(now.saturating_duration_since(l.submitted));
                }
            }
        }
        let copies = self.sched.kv_mut().take_copies();
        if let Err(e) = self.backend.copy_blocks(&copies) {
            self.sched.handle_step_failed(&format!("model error: {e}"), Instant::now());
            self.drain_events(live);
            return;
        }
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
            if let Event::LeaseExpired { transfer } = e {
                // The scheduler freed the blocks: the offer ends now, before any reader is confirmed.
                if let Some(pd) = self.pd.as_mut() {
                    pd.sender.abort(transfer.0);
                }
                continue;
            }
            if let Event::Finished { id, outcome, output_tokens, .. } = e {
                let mut times = Times::default();
                if let Some(l) = live.remove(&id.0) {
                    self.shared.ledger.lock().unwrap_or_else(|e| e.into_inner()).finish(&l.request_id);
                    times = l.times;
                }
                if let Some(pd) = &mut self.pd {
                    // A decode request that ends while its KV is still coming: end the pull too.
                    let pulling =
                        pd.incoming.iter().find(|(_, (r, _, _))| *r == id.0).map(|(&t, &(_, p, _))| (t, p));
                    if let Some((t, peer)) = pulling {
                        pd.incoming.remove(&t);
                        pd.receiver.abort(t);
                        while let Some((p, m)) = pd.receiver.poll_transmit() {
                            pd.io.send(p, &m, &[]);
                        }
                        pd.io.close(peer);
                    }
                }
                if let Outcome::PrefillDone { first_token, transfer, blocks } = &outcome {
                    if let Some(key) = self.offer(*transfer, blocks.clone()) {
                        if let Ok(c) = self.metrics.finished.with(&["completed", "prefilled"]) {
                            c.inc();
                        }
                        self.send(Reply::Prefilled {
                            id: id.0,
                            first_token: *first_token,
                            key,
                            blocks: blocks.len(),
                            times,
                        });
                        continue;
                    }
                    self.sched.handle_transfer_done(*transfer);
                    let outcome = Outcome::Failed {
                        stage: Stage::Prefilling,
                        reason: "could not offer the KV for transfer".into(),
                    };
                    self.send(Reply::Finished { id: id.0, outcome, output_tokens, times });
                    continue;
                }
                let stage = match &outcome {
                    Outcome::TimedOut { stage } | Outcome::Failed { stage, .. } => stage.as_str(),
                    _ => "finished",
                };
                if let Ok(c) = self.metrics.finished.with(&[outcome.label(), stage]) {
                    c.inc();
                }
                self.send(Reply::Finished { id: id.0, outcome, output_tokens, times });
            }
        }
    }

    /// Prefill role: offers a finished prompt's leased KV to decode workers.
    fn offer(&mut self, transfer: TransferId, blocks: Vec<pdserve_kvcache::BlockId>) -> Option<TransferKey> {
        let (_, expires_at) = self.sched.lease_of(transfer)?;
        let pd = self.pd.as_mut()?;
        pd.next_epoch = pd.next_epoch.wrapping_add(1);
        let key = TransferKey { transfer: transfer.0, epoch: pd.next_epoch };
        pd.sender.offer(key, pd.layout, blocks, expires_at).ok()?;
        pd.started.insert((true, key.transfer), Instant::now());
        Some(key)
    }

    /// Decode role: connects to the prefill worker and starts pulling into the request's lease.
    fn start_pull(&mut self, id: u64, r: &RemoteKv, deadline: Instant, now: Instant) {
        let transfer = TransferId(r.key.transfer);
        let dest: Vec<(pdserve_kvcache::BlockId, u32)> = match self.sched.kv().lease(transfer) {
            Ok(l) => l.blocks.iter().copied().zip(l.epochs.iter().copied()).collect(),
            Err(_) => return,
        };
        let deadline_ms =
            self.sched.now_ms(deadline).min(self.sched.lease_of(transfer).map_or(u64::MAX, |l| l.1));
        let Some(pd) = self.pd.as_mut() else {
            self.sched.handle_kv_failed(
                RequestId(id),
                "this worker has no KV transfer (not --role decode)",
                now,
            );
            return;
        };
        // Same host and a shared KV file: copy straight out of it; otherwise the bytes come over TCP.
        let block_floats = pd.layout.block_bytes() / 4;
        let shared = match &r.shm {
            Some(path) if pd.views.contains_key(path) => true,
            Some(path) => match pdserve_model::SharedKvView::open(path, block_floats) {
                Ok(v) => {
                    pd.views.insert(path.clone(), v);
                    true
                }
                Err(_) => false,
            },
            None => false,
        };
        let started = pd.io.connect(r.addr).map_err(|e| e.to_string()).and_then(|peer| {
            pd.receiver
                .start_with(r.key, peer, pd.layout, dest, deadline_ms, shared)
                .map_err(|e| format!("{e:?}"))?;
            pd.incoming.insert(r.key.transfer, (id, peer, if shared { r.shm.clone() } else { None }));
            pd.started.insert((false, r.key.transfer), Instant::now());
            Ok(())
        });
        if let Err(e) = started {
            self.sched.handle_kv_failed(
                RequestId(id),
                &format!("cannot reach the prefill worker at {}: {e}", r.addr),
                now,
            );
        }
    }

    /// Moves transfer frames: runs the sockets, feeds the state machines, copies block bytes between the
    /// network and the KV memory, and settles ended transfers with the scheduler.
    fn pump_transfers(&mut self, live: &mut HashMap<u64, Live>) {
        let Some(pd) = self.pd.as_mut() else { return };
        let now = Instant::now();
        let now_ms = self.sched.now_ms(now);
        // Lease expiry first, so no block is read after the scheduler frees it.
        pd.sender.handle_timeout(now_ms);
        pd.receiver.handle_timeout(now_ms);
        for r in pd.io.pump(Duration::ZERO) {
            match r.msg {
                Message::Block { key, index, len } if pd.incoming.contains_key(&key.transfer) => {
                    let Some(dst) = pd.receiver.accept_block(r.peer, key, index, len as usize) else {
                        continue;
                    };
                    if r.data.len() != len as usize
                        || self
                            .sched
                            .kv()
                            .check_write(TransferId(key.transfer), dst.block, dst.block_epoch)
                            .is_err()
                    {
                        continue; // a late or foreign block: never written
                    }
                    let floats: Vec<f32> = r
                        .data
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect();
                    if floats.len() * 4 != r.data.len()
                        || self.backend.write_block(dst.block, &floats).is_err()
                    {
                        pd.receiver.abort(key.transfer);
                        continue;
                    }
                    if let Ok(c) = self.metrics.transfer_bytes.with(&["received"]) {
                        c.add(r.data.len() as u64);
                    }
                    pd.receiver.block_written(key, index);
                }
                Message::BlockAt { key, index, slot } if pd.incoming.contains_key(&key.transfer) => {
                    let bytes = pd.layout.block_bytes();
                    let Some(dst) = pd.receiver.accept_block(r.peer, key, index, bytes) else { continue };
                    if self
                        .sched
                        .kv()
                        .check_write(TransferId(key.transfer), dst.block, dst.block_epoch)
                        .is_err()
                    {
                        continue;
                    }
                    // One copy, straight out of the prefill worker's shared KV memory. Whether the
                    // prefill lease held throughout is confirmed before the request may use it.
                    let view = pd
                        .incoming
                        .get(&key.transfer)
                        .and_then(|(_, _, p)| p.as_ref())
                        .and_then(|p| pd.views.get(p));
                    let Some(src) = view.and_then(|v| v.block(slot as usize)) else {
                        pd.receiver.abort(key.transfer);
                        continue;
                    };
                    if self.backend.write_block(dst.block, src).is_err() {
                        pd.receiver.abort(key.transfer);
                        continue;
                    }
                    if let Ok(c) = self.metrics.transfer_bytes.with(&["shared"]) {
                        c.add(bytes as u64);
                    }
                    pd.receiver.block_written(key, index);
                }
                msg if pd.incoming.contains_key(&msg.key().transfer) => {
                    pd.receiver.handle_message(r.peer, msg)
                }
                msg => {
                    // The scheduler's lease is the ground truth: no `Confirm` for blocks it has freed.
                    if let Message::Done { key } = &msg {
                        if self.sched.lease_of(TransferId(key.transfer)).is_none() {
                            pd.sender.abort(key.transfer);
                        }
                    }
                    pd.sender.handle_message(r.peer, msg)
                }
            }
        }
        for peer in pd.io.take_lost() {
            pd.sender.handle_peer_lost(peer);
            pd.receiver.handle_peer_lost(peer);
        }
        while let Some(a) = pd.sender.poll_action() {
            match a {
                SendAction::Message { peer, msg } => pd.io.send(peer, &msg, &[]),
                SendAction::Block { peer, key, index, block, shared } => {
                    let held = self
                        .sched
                        .lease_of(TransferId(key.transfer))
                        .is_some_and(|(b, _)| b.contains(&block));
                    if !held {
                        pd.sender.abort(key.transfer);
                        continue;
                    }
                    if shared {
                        pd.io.send(peer, &Message::BlockAt { key, index, slot: block.0 }, &[]);
                        continue;
                    }
                    let mut floats = vec![0.0f32; self.backend.kv_layout().block_floats()];
                    if self.backend.read_block(block, &mut floats).is_err() {
                        pd.sender.abort(key.transfer);
                        continue;
                    }
                    let bytes: Vec<u8> = floats.iter().flat_map(|v| v.to_le_bytes()).collect();
                    let msg = Message::Block { key, index, len: bytes.len() as u32 };
                    pd.io.send(peer, &msg, &bytes);
                    if let Ok(c) = self.metrics.transfer_bytes.with(&["sent"]) {
                        c.add(bytes.len() as u64);
                    }
                }
            }
        }
        while let Some((peer, msg)) = pd.receiver.poll_transmit() {
            pd.io.send(peer, &msg, &[]);
        }
        let mut ended = Vec::new();
        while let Some(e) = pd.sender.poll_event() {
            ended.push((true, e));
        }
        while let Some(e) = pd.receiver.poll_event() {
            ended.push((false, e));
        }
        self.metrics.transfers_in_flight.set((pd.sender.len() + pd.receiver.len()) as f64);
        for (sending, e) in ended {
            let t = e.key.transfer;
            let outcome = match &e.outcome {
                TransferOutcome::Completed => "completed",
                TransferOutcome::Failed(r) => r.as_str(),
            };
            if let Ok(c) =
                self.metrics.transfers_finished.with(&[if sending { "prefill" } else { "decode" }, outcome])
            {
                c.inc();
            }
            if let Some(started) = self.pd.as_mut().and_then(|pd| pd.started.remove(&(sending, t))) {
                if e.outcome == TransferOutcome::Completed {
                    self.metrics.transfer_time.observe_duration(started.elapsed());
                }
            }
            if sending {
                self.sched.handle_transfer_done(TransferId(t));
                continue;
            }
            let Some(pd) = self.pd.as_mut() else { return };
            let Some((req, peer, _)) = pd.incoming.remove(&t) else { continue };
            while let Some((p, m)) = pd.receiver.poll_transmit() {
                pd.io.send(p, &m, &[]);
            }
            pd.io.close(peer);
            match e.outcome {
                TransferOutcome::Completed => {
                    let first = self.sched.awaiting_first_token(RequestId(req));
                    if let (Some(first), Some(l)) = (first, live.get_mut(&req)) {
                        l.times.kv_arrived = Some(now);
                        let stop =
                            l.stop_ids.contains(&first) || (!l.ignore_eos && self.eos_ids.contains(&first));
                        self.sched.handle_kv_arrived(RequestId(req), stop, now);
                        self.send(Reply::Token {
                            id: req,
                            token: first,
                            logprob: 0.0,
                            top: Vec::new(),
                            stop,
                        });
                    }
                }
                TransferOutcome::Failed(reason) => {
                    self.sched.handle_kv_failed(
                        RequestId(req),
                        &format!("KV transfer failed: {reason}"),
                        now,
                    );
                }
            }
        }
        self.drain_events(live);
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
