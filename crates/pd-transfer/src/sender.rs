//! The prefill side: holds offered transfers (their KV is under a kvcache lease) and streams blocks to
//! the decode worker that pulls them.

use std::collections::{HashMap, VecDeque};

use pdserve_kvcache::BlockId;

use crate::message::{FailReason, Layout, Message, PromptMeta, TransferKey};
use crate::{PeerId, TransferError, TransferEvent, TransferOutcome};

/// What the I/O shell must send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendAction {
    Message {
        peer: PeerId,
        msg: Message,
    },
    /// Send block `index` of `key`: read `block`'s bytes from the KV memory into a `Block` frame, or,
    /// when `shared`, send `BlockAt` naming the block's slot in the shared KV region.
    Block {
        peer: PeerId,
        key: TransferKey,
        index: u32,
        shared: bool,
        block: BlockId,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Offered,
    /// A pull was accepted; waiting for the receiver's `Ready`.
    Accepted {
        peer: PeerId,
        shared: bool,
    },
    Sending {
        peer: PeerId,
        next: u32,
        written: u32,
        shared: bool,
    },
}

impl State {
    /// The receiver that claimed the transfer, if one did.
    fn holder(self) -> Option<PeerId> {
        match self {
            State::Offered => None,
            State::Accepted { peer, .. } | State::Sending { peer, .. } => Some(peer),
        }
    }
}

#[derive(Debug)]
struct Out {
    epoch: u32,
    layout: Layout,
    blocks: Vec<BlockId>,
    expires_at: u64,
    state: State,
    /// Sent once, in the `Accept`.
    meta: Option<Box<PromptMeta>>,
}

/// Configuration of a [`Sender`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SenderConfig {
    /// Blocks sent inline and not yet acknowledged, per transfer (named blocks are not windowed).
    pub window_blocks: u32,
    /// Offered transfers held at once.
    pub transfers_max: usize,
    /// This worker's KV memory is a shared region a same-host receiver can read.
    pub shared_region: bool,
}

impl Default for SenderConfig {
    fn default() -> Self {
        SenderConfig { window_blocks: 64, transfers_max: 4096, shared_region: false }
    }
}

/// The prefill side of every transfer of one worker. Sans-IO: messages and `now` (in the caller's
/// clock unit) come in, actions and events come out.
///
/// Order per turn: `handle_*` calls, then `poll_action` and `poll_event` until `None`; call
/// `handle_timeout(now)` when `poll_timeout()` is due.
#[derive(Debug)]
pub struct Sender {
    config: SenderConfig,
    transfers: HashMap<u64, Out>,
    actions: VecDeque<SendAction>,
    events: VecDeque<TransferEvent>,
}

impl Sender {
    pub fn new(config: SenderConfig) -> Self {
        Sender { config, transfers: HashMap::new(), actions: VecDeque::new(), events: VecDeque::new() }
    }

    /// Offers the KV of a finished prefill: `blocks` (in order) stay readable until the transfer ends;
    /// at `expires_at` it ends as `LeaseExpired` if no decode worker took it. `meta` goes to the
    /// receiver in the `Accept`.
    pub fn offer(
        &mut self,
        key: TransferKey,
        layout: Layout,
        blocks: Vec<BlockId>,
        expires_at: u64,
        meta: PromptMeta,
    ) -> Result<(), TransferError> {
        if self.transfers.contains_key(&key.transfer) {
            return Err(TransferError::Duplicate);
        }
        if self.transfers.len() >= self.config.transfers_max {
            return Err(TransferError::TooMany { limit: self.config.transfers_max });
        }
        self.transfers.insert(
            key.transfer,
            Out {
                epoch: key.epoch,
                layout,
                blocks,
                expires_at,
                state: State::Offered,
                meta: Some(Box::new(meta)),
            },
        );
        Ok(())
    }

    /// Transfers not ended yet.
    pub fn len(&self) -> usize {
        self.transfers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.transfers.is_empty()
    }

    pub fn poll_action(&mut self) -> Option<SendAction> {
        self.actions.pop_front()
    }

    pub fn poll_event(&mut self) -> Option<TransferEvent> {
        self.events.pop_front()
    }

    /// The earliest lease expiry.
    pub fn poll_timeout(&self) -> Option<u64> {
        self.transfers.values().map(|o| o.expires_at).min()
    }

    fn reply(&mut self, peer: PeerId, msg: Message) {
        self.actions.push_back(SendAction::Message { peer, msg });
    }

    fn end(&mut self, transfer: u64, outcome: TransferOutcome) {
        if let Some(o) = self.transfers.remove(&transfer) {
            self.events.push_back(TransferEvent { key: TransferKey { transfer, epoch: o.epoch }, outcome });
        }
    }

    /// A message from `peer`. Messages for unknown transfers or other epochs are answered (a `Pull`)
    /// or dropped, never acted on.
    pub fn handle_message(&mut self, peer: PeerId, msg: Message) {
        let key = msg.key();
        let current = self.transfers.get(&key.transfer).map(|o| (o.epoch, o.state));
        match msg {
            Message::Pull { layout, shared, .. } => {
                let Some((epoch, state)) = current else {
                    return self.reply(peer, Message::Reject { key, reason: FailReason::UnknownTransfer });
                };
                if epoch != key.epoch {
                    return self.reply(peer, Message::Reject { key, reason: FailReason::StaleEpoch });
                }
                if state != State::Offered {
                    return self.reply(peer, Message::Reject { key, reason: FailReason::AlreadyClaimed });
                }
                let o = &self.transfers[&key.transfer];
                if o.layout != layout {
                    // A mismatch ends the transfer on both sides: never garbage KV.
                    let reason = FailReason::LayoutMismatch { sender: o.layout, receiver: layout };
                    self.reply(peer, Message::Reject { key, reason: reason.clone() });
                    return self.end(key.transfer, TransferOutcome::Failed(reason));
                }
                let shared = shared && self.config.shared_region;
                let Some(o) = self.transfers.get_mut(&key.transfer) else { return };
                let blocks = o.blocks.len() as u32;
                let meta = o.meta.take().unwrap_or_default();
                o.state = State::Accepted { peer, shared };
                self.reply(peer, Message::Accept { key, blocks, meta });
            }
            Message::Ready { from, .. } => {
                if let Some((epoch, State::Accepted { peer: p, shared })) = current {
                    if epoch == key.epoch && p == peer {
                        let n = self.transfers.get(&key.transfer).map_or(0, |o| o.blocks.len() as u32);
                        if from > n {
                            self.reply(peer, Message::Abort { key, reason: FailReason::Protocol });
                            return self.end(key.transfer, TransferOutcome::Failed(FailReason::Protocol));
                        }
                        if from == n {
                            // The receiver holds every block already: nothing to send, and the lease
                            // held until now, so the transfer is complete (the `Ready` is its `Done`).
                            self.reply(peer, Message::Confirm { key });
                            return self.end(key.transfer, TransferOutcome::Completed);
                        }
                        // Blocks before `from` the receiver holds already: they are never sent.
                        if let Some(o) = self.transfers.get_mut(&key.transfer) {
                            o.state = State::Sending { peer, next: from, written: from, shared };
                        }
                        self.fill_window(key.transfer);
                    }
                }
            }
            Message::Ack { written, .. } => {
                if let Some((epoch, State::Sending { peer: p, next, .. })) = current {
                    if epoch == key.epoch && p == peer && written <= next {
                        if let Some(o) = self.transfers.get_mut(&key.transfer) {
                            if let State::Sending { written: w, .. } = &mut o.state {
                                *w = (*w).max(written);
                            }
                        }
                        self.fill_window(key.transfer);
                    }
                }
            }
            Message::Done { .. } => {
                match current {
                    Some((epoch, State::Sending { peer: p, next, .. }))
                        if epoch == key.epoch && p == peer =>
                    {
                        let n = self.transfers[&key.transfer].blocks.len() as u32;
                        if next == n {
                            // Still holding the lease now means it held while every block was read.
                            self.reply(peer, Message::Confirm { key });
                            self.end(key.transfer, TransferOutcome::Completed);
                        }
                    }
                    // The lease is gone (expired, aborted): the receiver must not trust what it read.
                    _ => self.reply(peer, Message::Reject { key, reason: FailReason::UnknownTransfer }),
                }
            }
            Message::Abort { reason, .. } => {
                let from_holder = match current {
                    // Before any pull, only a matching epoch may end the offer.
                    Some((epoch, state)) => epoch == key.epoch && state.holder().is_none_or(|p| p == peer),
                    None => false,
                };
                if from_holder {
                    self.end(key.transfer, TransferOutcome::Failed(reason));
                }
            }
            // Messages only a receiver takes: a confused peer; ignore.
            Message::Accept { .. }
            | Message::Reject { .. }
            | Message::Block { .. }
            | Message::BlockAt { .. }
            | Message::Confirm { .. } => {}
        }
    }

    fn fill_window(&mut self, transfer: u64) {
        let Some(o) = self.transfers.get_mut(&transfer) else { return };
        let State::Sending { peer, next, written, shared } = &mut o.state else { return };
        // Named blocks cost a few bytes each and the receiver reads them at its own pace: they all go
        // at once, so a transfer takes one round trip whatever its size. Inline bytes keep a window.
        let window = if *shared { u32::MAX } else { self.config.window_blocks.max(1) };
        let key = TransferKey { transfer, epoch: o.epoch };
        while *next < o.blocks.len() as u32 && *next - *written < window {
            self.actions.push_back(SendAction::Block {
                peer: *peer,
                key,
                index: *next,
                block: o.blocks[*next as usize],
                shared: *shared,
            });
            *next += 1;
        }
    }

    /// Ends a transfer from this side (the router or the client gave up); tells the peer if one is
    /// pulling. Idempotent: `false` if it had already ended.
    pub fn abort(&mut self, transfer: u64) -> bool {
        let Some(o) = self.transfers.get(&transfer) else { return false };
        if let Some(peer) = o.state.holder() {
            let key = TransferKey { transfer, epoch: o.epoch };
            self.reply(peer, Message::Abort { key, reason: FailReason::Aborted });
        }
        self.end(transfer, TransferOutcome::Failed(FailReason::Aborted));
        true
    }

    /// Ends every transfer whose lease expired at or before `now`.
    pub fn handle_timeout(&mut self, now: u64) {
        let due: Vec<u64> =
            self.transfers.iter().filter(|(_, o)| o.expires_at <= now).map(|(&t, _)| t).collect();
        for t in due {
            if let Some(peer) = self.transfers.get(&t).and_then(|o| o.state.holder()) {
                let key = TransferKey { transfer: t, epoch: self.transfers[&t].epoch };
                self.reply(peer, Message::Abort { key, reason: FailReason::LeaseExpired });
            }
            self.end(t, TransferOutcome::Failed(FailReason::LeaseExpired));
        }
    }

    /// The peer's connection died: every transfer it was pulling ends.
    pub fn handle_peer_lost(&mut self, peer: PeerId) {
        let lost: Vec<u64> =
            self.transfers.iter().filter(|(_, o)| o.state.holder() == Some(peer)).map(|(&t, _)| t).collect();
        for t in lost {
            self.end(t, TransferOutcome::Failed(FailReason::Aborted));
        }
    }
}
