//! The decode side: pulls a transfer's blocks into destination blocks it allocated under its own lease.

use std::collections::{HashMap, VecDeque};

use pdserve_kvcache::BlockId;

use crate::message::{FailReason, Layout, Message, TransferKey};
use crate::{Outcome, PeerId, TransferEvent};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Pulling,
    Receiving,
    /// Every block is written; waiting for the sender to confirm its lease held.
    Confirming,
}

#[derive(Debug)]
struct In {
    epoch: u32,
    peer: PeerId,
    dest: Vec<(BlockId, u32)>,
    written: Vec<bool>,
    count: u32,
    deadline: u64,
    state: State,
    block_bytes: usize,
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
#[derive(Debug)]
pub struct Receiver {
    transfers: HashMap<u64, In>,
    out: VecDeque<(PeerId, Message)>,
    events: VecDeque<TransferEvent>,
    ack_every: u32,
}

/// Why a transfer could not be started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartError {
    Duplicate,
    NoBlocks,
}

impl Receiver {
    /// `ack_every`: acknowledge after this many written blocks (the sender's window should be larger).
    pub fn new(ack_every: u32) -> Self {
        Receiver {
            transfers: HashMap::new(),
            out: VecDeque::new(),
            events: VecDeque::new(),
            ack_every: ack_every.max(1),
        }
    }

    /// Starts pulling `key` from `peer` into `dest` (block, epoch at allocation), which must be as many
    /// blocks as the sender holds. Ends as `DataTimeout` at `deadline`.
    pub fn start(
        &mut self,
        key: TransferKey,
        peer: PeerId,
        layout: Layout,
        dest: Vec<(BlockId, u32)>,
        deadline: u64,
    ) -> Result<(), StartError> {
        self.start_with(key, peer, layout, dest, deadline, false)
    }

    /// Like [`start`](Self::start); `shared`: this worker can read the sender's shared KV region, so
    /// the sender may name blocks (`BlockAt`) instead of sending their bytes.
    pub fn start_with(
        &mut self,
        key: TransferKey,
        peer: PeerId,
        layout: Layout,
        dest: Vec<(BlockId, u32)>,
        deadline: u64,
        shared: bool,
    ) -> Result<(), StartError> {
        if self.transfers.contains_key(&key.transfer) {
            return Err(StartError::Duplicate);
        }
        if dest.is_empty() {
            return Err(StartError::NoBlocks);
        }
        let n = dest.len();
        self.out.push_back((peer, Message::Pull { key, layout, blocks: n as u32, shared }));
        self.transfers.insert(
            key.transfer,
            In {
                epoch: key.epoch,
                peer,
                dest,
                written: vec![false; n],
                count: 0,
                deadline,
                state: State::Pulling,
                block_bytes: layout.block_bytes(),
            },
        );
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

    fn end(&mut self, transfer: u64, outcome: Outcome) {
        if let Some(i) = self.transfers.remove(&transfer) {
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
            Message::Accept { blocks, .. } => {
                // With a reordering link a block may have come first and started the transfer already.
                let n = self.transfers[&key.transfer].dest.len() as u32;
                if blocks != n {
                    self.out.push_back((peer, Message::Abort { key, reason: FailReason::Protocol }));
                    return self.end(key.transfer, Outcome::Failed(FailReason::Protocol));
                }
                if let Some(i) = self.transfers.get_mut(&key.transfer).filter(|i| i.state == State::Pulling) {
                    i.state = State::Receiving;
                }
            }
            Message::Reject { reason, .. } | Message::Abort { reason, .. } => {
                self.end(key.transfer, Outcome::Failed(reason))
            }
            Message::Confirm { .. } if state == State::Confirming => {
                self.end(key.transfer, Outcome::Completed)
            }
            Message::Confirm { .. }
            | Message::Block { .. }
            | Message::BlockAt { .. }
            | Message::Pull { .. }
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
        // A block can overtake the `Accept` on a reordering link; it proves the sender accepted.
        let i = if i.state == State::Pulling {
            let i = self.transfers.get_mut(&key.transfer)?;
            i.state = State::Receiving;
            &*i
        } else {
            i
        };
        if index as usize >= i.dest.len() || len != i.block_bytes {
            self.out.push_back((peer, Message::Abort { key, reason: FailReason::Protocol }));
            self.end(key.transfer, Outcome::Failed(FailReason::Protocol));
            return None;
        }
        if i.written[index as usize] {
            return None;
        }
        let (block, block_epoch) = i.dest[index as usize];
        Some(Destination { block, block_epoch })
    }

    /// Records that block `index` was written; acknowledges, and completes the transfer after the last.
    pub fn block_written(&mut self, key: TransferKey, index: u32) {
        let ack_every = self.ack_every;
        let Some(i) = self.transfers.get_mut(&key.transfer).filter(|i| i.epoch == key.epoch) else { return };
        let Some(w) = i.written.get_mut(index as usize) else { return };
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
            self.out.push_back((peer, Message::Ack { key, written: count }));
        }
    }

    /// Ends a transfer from this side and tells the peer. Idempotent.
    pub fn abort(&mut self, transfer: u64) -> bool {
        let Some(i) = self.transfers.get(&transfer) else { return false };
        let key = TransferKey { transfer, epoch: i.epoch };
        self.out.push_back((i.peer, Message::Abort { key, reason: FailReason::Aborted }));
        self.end(transfer, Outcome::Failed(FailReason::Aborted));
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
            self.end(t, Outcome::Failed(FailReason::DataTimeout));
        }
    }

    /// The connection to `peer` died: its transfers end.
    pub fn handle_peer_lost(&mut self, peer: PeerId) {
        let lost: Vec<u64> = self.transfers.iter().filter(|(_, i)| i.peer == peer).map(|(&t, _)| t).collect();
        for t in lost {
            self.end(t, Outcome::Failed(FailReason::Aborted));
        }
    }
}
