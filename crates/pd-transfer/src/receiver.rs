//! The decode side: learns what a transfer holds, then pulls its blocks into destination blocks it
//! allocated under its own lease.

use std::collections::{HashMap, VecDeque};

use pdserve_kvcache::BlockId;

use crate::message::{FailReason, Layout, Message, PromptMeta, TransferKey};
use crate::{PeerId, TransferError, TransferEvent, TransferOutcome};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// `Pull` sent; waiting for the sender's `Accept`.
    Pulling,
    /// Accepted: the shell learned the prompt and the block count and is to give destinations.
    Described,
    Receiving,
    /// Every block is written; waiting for the sender to confirm its lease held.
    Confirming,
}

#[derive(Debug)]
struct In {
    epoch: u32,
    peer: PeerId,
    /// The sender's block count, from its `Accept`.
    blocks: u32,
    /// The first block pulled; those before it are held here already.
    from: u32,
    /// Destinations of blocks `from..blocks`.
    dest: Vec<(BlockId, u32)>,
    written: Vec<bool>,
    count: u32,
    deadline: u64,
    state: State,
    block_bytes: usize,
}

/// A transfer the sender accepted: what it holds. The shell allocates `blocks` destination blocks
/// (or gives up with [`Receiver::abort`]) and calls [`Receiver::set_destination`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Described {
    pub key: TransferKey,
    pub blocks: u32,
    pub meta: PromptMeta,
}

/// Where a received block goes. The shell checks the destination against its KV cache
/// (`KvCache::check_write(transfer, block, epoch)`), copies the bytes, then calls
/// [`Receiver::block_written`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Destination {
    pub block: BlockId,
    pub block_epoch: u32,
}

/// The decode side of every transfer of one worker. Sans-IO, like [`crate::Sender`].
///
/// Order per transfer: [`start`](Self::start) (sends `Pull`); [`poll_described`](Self::poll_described)
/// yields the sender's answer; [`set_destination`](Self::set_destination) (sends `Ready`); blocks go
/// through [`accept_block`](Self::accept_block) and [`block_written`](Self::block_written); the end
/// comes out of [`poll_event`](Self::poll_event). Every turn: `poll_transmit` until `None`.
#[derive(Debug)]
pub struct Receiver {
    transfers: HashMap<u64, In>,
    out: VecDeque<(PeerId, Message)>,
    described: VecDeque<Described>,
    events: VecDeque<TransferEvent>,
    ack_every: u32,
}

impl Receiver {
    /// `ack_every`: acknowledge after this many written blocks (the sender's window should be larger).
    pub fn new(ack_every: u32) -> Self {
        Receiver {
            transfers: HashMap::new(),
            out: VecDeque::new(),
            described: VecDeque::new(),
            events: VecDeque::new(),
            ack_every: ack_every.max(1),
        }
    }

    /// Starts pulling `key` from `peer`: asks the sender what it holds. `shared`: this worker can read
    /// the sender's shared KV region, so the sender may name blocks (`BlockAt`) instead of sending
    /// their bytes. The transfer ends as `DataTimeout` if it is not complete by `deadline`.
    pub fn start(
        &mut self,
        key: TransferKey,
        peer: PeerId,
        layout: Layout,
        deadline: u64,
        shared: bool,
    ) -> Result<(), TransferError> {
        if self.transfers.contains_key(&key.transfer) {
            return Err(TransferError::Duplicate);
        }
        self.out.push_back((peer, Message::Pull { key, layout, shared }));
        self.transfers.insert(
            key.transfer,
            In {
                epoch: key.epoch,
                peer,
                blocks: 0,
                from: 0,
                dest: Vec::new(),
                written: Vec::new(),
                count: 0,
                deadline,
                state: State::Pulling,
                block_bytes: layout.block_bytes(),
            },
        );
        Ok(())
    }

    /// The next transfer the sender accepted: what it holds.
    pub fn poll_described(&mut self) -> Option<Described> {
        self.described.pop_front()
    }

    /// Gives a described transfer its destination blocks (block, epoch at allocation) for sender blocks
    /// `from..` and tells the sender to send those; the blocks before `from` this worker holds already
    /// (its own prefix cache). A wrong count ends the transfer (both sides). With nothing left to pull
    /// (`from` is the block count) the sender confirms at once that its lease held.
    pub fn set_destination(
        &mut self,
        transfer: u64,
        from: u32,
        dest: Vec<(BlockId, u32)>,
    ) -> Result<(), TransferError> {
        let Some(i) = self.transfers.get_mut(&transfer).filter(|i| i.state == State::Described) else {
            return Err(TransferError::NotDescribed);
        };
        let key = TransferKey { transfer, epoch: i.epoch };
        if from > i.blocks || dest.len() != (i.blocks - from) as usize {
            let receiver = from.saturating_add(dest.len() as u32);
            let reason = FailReason::BlockCountMismatch { sender: i.blocks, receiver };
            let (peer, sender) = (i.peer, i.blocks);
            self.out.push_back((peer, Message::Abort { key, reason: reason.clone() }));
            self.end(transfer, TransferOutcome::Failed(reason));
            return Err(TransferError::BlockCount { sender, receiver });
        }
        i.written = vec![false; dest.len()];
        i.from = from;
        i.dest = dest;
        self.out.push_back((i.peer, Message::Ready { key, from }));
        // With nothing to pull, the sender answers the `Ready` as it would a `Done`.
        i.state = if i.dest.is_empty() { State::Confirming } else { State::Receiving };
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.transfers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.transfers.is_empty()
    }

    pub fn poll_transmit(&mut self) -> Option<(PeerId, Message)> {
        self.out.pop_front()
    }

    pub fn poll_event(&mut self) -> Option<TransferEvent> {
        self.events.pop_front()
    }

    pub fn poll_timeout(&self) -> Option<u64> {
        self.transfers.values().map(|i| i.deadline).min()
    }

    fn end(&mut self, transfer: u64, outcome: TransferOutcome) {
        if let Some(i) = self.transfers.remove(&transfer) {
            // A description nobody took yet is withdrawn: the shell sees the end instead.
            self.described.retain(|d| d.key.transfer != transfer);
            self.events.push_back(TransferEvent { key: TransferKey { transfer, epoch: i.epoch }, outcome });
        }
    }

    fn current(&self, peer: PeerId, key: TransferKey) -> Option<&In> {
        self.transfers.get(&key.transfer).filter(|i| i.epoch == key.epoch && i.peer == peer)
    }

    /// A control message from `peer` (anything but `Block`, which goes through [`accept_block`]).
    pub fn handle_message(&mut self, peer: PeerId, msg: Message) {
        let key = msg.key();
        let Some(state) = self.current(peer, key).map(|i| i.state) else {
            return; // late or stray: dropped
        };
        match msg {
            Message::Accept { blocks, meta, .. } => {
                if state != State::Pulling {
                    return; // a duplicate
                }
                if blocks == 0 {
                    self.out.push_back((peer, Message::Abort { key, reason: FailReason::Protocol }));
                    return self.end(key.transfer, TransferOutcome::Failed(FailReason::Protocol));
                }
                if let Some(i) = self.transfers.get_mut(&key.transfer) {
                    i.blocks = blocks;
                    i.state = State::Described;
                }
                self.described.push_back(Described { key, blocks, meta: *meta });
            }
            Message::Reject { reason, .. } | Message::Abort { reason, .. } => {
                self.end(key.transfer, TransferOutcome::Failed(reason))
            }
            Message::Confirm { .. } if state == State::Confirming => {
                self.end(key.transfer, TransferOutcome::Completed)
            }
            Message::Confirm { .. }
            | Message::Block { .. }
            | Message::BlockAt { .. }
            | Message::Pull { .. }
            | Message::Ready { .. }
            | Message::Ack { .. }
            | Message::Done { .. } => {}
        }
    }

    /// Where block `index` of `key` goes, or `None` if the block must be dropped unwritten (an ended
    /// transfer, another epoch, a duplicate, a wrong size). A wrong size ends the transfer.
    pub fn accept_block(
        &mut self,
        peer: PeerId,
        key: TransferKey,
        index: u32,
        len: usize,
    ) -> Option<Destination> {
        let i = self.current(peer, key)?;
        // Blocks follow the receiver's `Ready`; one before it, out of range or of the wrong size is
        // a confused sender.
        let wrong = match i.state {
            State::Pulling | State::Described => true,
            State::Receiving | State::Confirming => {
                index < i.from || index >= i.blocks || len != i.block_bytes
            }
        };
        if wrong {
            self.out.push_back((peer, Message::Abort { key, reason: FailReason::Protocol }));
            self.end(key.transfer, TransferOutcome::Failed(FailReason::Protocol));
            return None;
        }
        let at = (index - i.from) as usize;
        if i.written[at] {
            return None;
        }
        let (block, block_epoch) = i.dest[at];
        Some(Destination { block, block_epoch })
    }

    /// Records that block `index` was written; acknowledges, and completes the transfer after the last.
    pub fn block_written(&mut self, key: TransferKey, index: u32) {
        let ack_every = self.ack_every;
        let Some(i) = self.transfers.get_mut(&key.transfer).filter(|i| i.epoch == key.epoch) else { return };
        let Some(w) = index.checked_sub(i.from).and_then(|at| i.written.get_mut(at as usize)) else { return };
        if *w {
            return;
        }
        *w = true;
        i.count += 1;
        let (peer, count, n) = (i.peer, i.count, i.dest.len() as u32);
        if count == n {
            // Complete only once the sender confirms its lease held while the blocks were read.
            i.state = State::Confirming;
            self.out.push_back((peer, Message::Done { key }));
        } else if count % ack_every == 0 {
            // In the sender's numbering: blocks before `from` count as written.
            self.out.push_back((peer, Message::Ack { key, written: i.from + count }));
        }
    }

    /// Ends a transfer from this side and tells the peer. Idempotent.
    pub fn abort(&mut self, transfer: u64) -> bool {
        self.fail(transfer, FailReason::Aborted)
    }

    /// Ends `transfer` for `reason`, telling the sender (an abort of any other cause).
    pub fn fail(&mut self, transfer: u64, reason: FailReason) -> bool {
        let Some(i) = self.transfers.get(&transfer) else { return false };
        let key = TransferKey { transfer, epoch: i.epoch };
        self.out.push_back((i.peer, Message::Abort { key, reason: reason.clone() }));
        self.end(transfer, TransferOutcome::Failed(reason));
        true
    }

    /// Ends every transfer whose data did not all arrive by `now`.
    pub fn handle_timeout(&mut self, now: u64) {
        let due: Vec<u64> =
            self.transfers.iter().filter(|(_, i)| i.deadline <= now).map(|(&t, _)| t).collect();
        for t in due {
            let i = &self.transfers[&t];
            let key = TransferKey { transfer: t, epoch: i.epoch };
            self.out.push_back((i.peer, Message::Abort { key, reason: FailReason::DataTimeout }));
            self.end(t, TransferOutcome::Failed(FailReason::DataTimeout));
        }
    }

    /// The connection to `peer` died: its transfers end.
    pub fn handle_peer_lost(&mut self, peer: PeerId) {
        let lost: Vec<u64> = self.transfers.iter().filter(|(_, i)| i.peer == peer).map(|(&t, _)| t).collect();
        for t in lost {
            self.end(t, TransferOutcome::Failed(FailReason::Aborted));
        }
    }
}
