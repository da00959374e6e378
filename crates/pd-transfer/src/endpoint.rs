//! One worker's end of every KV transfer, whole: the [`Sender`] and [`Receiver`] state machines over a
//! [`Transport`], copying block bytes between the transport and the worker's KV memory
//! ([`BlockMemory`]) only where the worker's KV ledger ([`Ledger`]: a `pdserve_kvcache::KvCache`, or one that answers for more) allows it.
//!
//! Call order per turn of the worker's loop: [`pump`](Endpoint::pump) (runs timeouts, the transport,
//! the state machines, and the copies), then [`poll_event`](Endpoint::poll_event) until `None`,
//! settling each event with the KV ledger. Commands ([`offer`](Endpoint::offer),
//! [`pull`](Endpoint::pull), [`set_destination`](Endpoint::set_destination),
//! [`abort`](Endpoint::abort)) may come at any time between pumps.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use pdserve_kvcache::{BlockId, KvCache, TransferId};

use crate::transport::shm::SharedRegion;
use crate::transport::{Arrival, Transport};
use crate::{
    Layout, Message, PeerId, PromptMeta, Receiver, SendAction, Sender, SenderConfig, TransferError,
    TransferKey, TransferOutcome,
};

/// The worker's KV memory as the endpoint reads and writes it: whole blocks of
/// `Layout::block_bytes()` bytes, indexed by the ledger's block ids.
pub trait BlockMemory {
    /// Copies block `block` into `out`.
    fn read_block(&self, block: BlockId, out: &mut [u8]) -> Result<(), TransferError>;
    /// Stores `data` as block `block`.
    fn write_block(&mut self, block: BlockId, data: &[u8]) -> Result<(), TransferError>;
    /// Block `block` (`len` bytes) where it lies, for memory that can lend it (the sender checksums a
    /// block it names without copying it); `None` otherwise (it is read with `read_block`).
    fn block(&self, block: BlockId, len: usize) -> Option<&[u8]> {
        let _ = (block, len);
        None
    }
    /// [`write_block`](Self::write_block), returning [`striped`](crate::striped)`(data)`: memory
    /// that can lend the block mutably computes it in the pass that copies (`copy_striped`), so a
    /// receiver checks a block for little more than storing it.
    fn write_block_striped(&mut self, block: BlockId, data: &[u8]) -> Result<u32, TransferError> {
        let digest = crate::checksum::striped(data);
        self.write_block(block, data)?;
        Ok(digest)
    }
}

/// Block `block` of `n` bytes in memory that holds blocks end to end.
fn flat(block: BlockId, n: usize, len: usize) -> Result<std::ops::Range<usize>, TransferError> {
    let start = block.0 as usize * n;
    (start + n <= len).then_some(start..start + n).ok_or(TransferError::BlockIo { block })
}

/// Blocks end to end on the heap (block `b` at `b * block_bytes`).
impl BlockMemory for Vec<u8> {
    fn read_block(&self, block: BlockId, out: &mut [u8]) -> Result<(), TransferError> {
        out.copy_from_slice(&self[flat(block, out.len(), self.len())?]);
        Ok(())
    }
    fn write_block(&mut self, block: BlockId, data: &[u8]) -> Result<(), TransferError> {
        let r = flat(block, data.len(), self.len())?;
        self[r].copy_from_slice(data);
        Ok(())
    }
    fn block(&self, block: BlockId, len: usize) -> Option<&[u8]> {
        flat(block, len, self.len()).ok().map(|r| &self[r])
    }
    fn write_block_striped(&mut self, block: BlockId, data: &[u8]) -> Result<u32, TransferError> {
        let r = flat(block, data.len(), self.len())?;
        Ok(crate::checksum::copy_striped(&mut self[r], data))
    }
}

/// Blocks end to end in a shared region (a prefill worker's `--kv-shm` memory).
impl BlockMemory for SharedRegion {
    fn read_block(&self, block: BlockId, out: &mut [u8]) -> Result<(), TransferError> {
        out.copy_from_slice(&self.bytes()[flat(block, out.len(), self.bytes().len())?]);
        Ok(())
    }
    fn write_block(&mut self, block: BlockId, data: &[u8]) -> Result<(), TransferError> {
        let r = flat(block, data.len(), self.bytes().len())?;
        self.bytes_mut()[r].copy_from_slice(data);
        Ok(())
    }
    fn block(&self, block: BlockId, len: usize) -> Option<&[u8]> {
        flat(block, len, self.bytes().len()).ok().map(|r| &self.bytes()[r])
    }
    fn write_block_striped(&mut self, block: BlockId, data: &[u8]) -> Result<u32, TransferError> {
        let r = flat(block, data.len(), self.bytes().len())?;
        Ok(crate::checksum::copy_striped(&mut self.bytes_mut()[r], data))
    }
}

/// What the endpoint asks of the worker's KV ledger before it touches KV memory: whether a
/// transfer's lease is live, holds a block it reads, or allows a write. A plain `KvCache` is one; a
/// worker whose leases hold more than blocks (a per-request state moved as blocks of its slot, say)
/// answers for those too.
pub trait Ledger {
    /// Whether `transfer`'s lease is live.
    fn leased(&self, transfer: TransferId) -> bool;
    /// Whether `transfer`'s lease holds `block` (a sender reads only such blocks).
    fn holds(&self, transfer: TransferId, block: BlockId) -> bool;
    /// Whether a block received for `transfer` may be stored in `block`, allocated at `epoch`.
    fn may_write(&self, transfer: TransferId, block: BlockId, epoch: u32) -> bool;
}

impl Ledger for KvCache {
    fn leased(&self, transfer: TransferId) -> bool {
        self.lease(transfer).is_ok()
    }
    fn holds(&self, transfer: TransferId, block: BlockId) -> bool {
        self.lease(transfer).is_ok_and(|l| l.blocks.contains(&block))
    }
    fn may_write(&self, transfer: TransferId, block: BlockId, epoch: u32) -> bool {
        self.check_write(transfer, block, epoch).is_ok()
    }
}

/// Bounds of an [`Endpoint`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndpointConfig {
    pub sender: SenderConfig,
    /// The receiver acknowledges every this many written blocks.
    pub ack_every: u32,
    /// Transfers this side receives at once.
    pub pulls_max: usize,
    /// The first epoch this endpoint gives its offers (different per process, so a handle from an
    /// earlier incarnation of the worker is refused as stale).
    pub epoch_seed: u32,
    /// Blocks sent inline carry their checksum (on by default; a receiver checks every block that
    /// carries one, and a block sent with checksums off carries 0, which is never checked).
    pub checksums: bool,
    /// Test hooks: faults of the sending side (none by default).
    pub faults: SenderFaults,
}

/// Test hooks of the sending side (a worker's `--test-stall-transfer N`, `--test-drop-done N`),
/// chosen by the offered prompt's length so a test can aim them at its own requests: an offer of a
/// prompt of at least `stall_from` tokens sends its first block and then nothing more (a sender stuck
/// mid-transfer after the handshake); one of at least `drop_done_from` tokens (and under
/// `stall_from`) never hears the receiver's `Done` (the notice lost on the way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SenderFaults {
    pub stall_from: Option<usize>,
    pub drop_done_from: Option<usize>,
}

/// A fault the hooks put on one offer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// To stall after the first block it sends (whatever its index: the receiver may start past
    /// blocks it holds already) ...
    Stall,
    /// ... and that block sent.
    Stalled,
    DropDone,
}

impl SenderFaults {
    fn of(&self, prompt_tokens: usize) -> Option<Fault> {
        if self.stall_from.is_some_and(|n| prompt_tokens >= n) {
            Some(Fault::Stall)
        } else if self.drop_done_from.is_some_and(|n| prompt_tokens >= n) {
            Some(Fault::DropDone)
        } else {
            None
        }
    }
}

impl Default for EndpointConfig {
    fn default() -> Self {
        EndpointConfig {
            sender: SenderConfig::default(),
            ack_every: 4,
            pulls_max: 1024,
            epoch_seed: 1,
            checksums: true,
            faults: SenderFaults::default(),
        }
    }
}

/// Where to pull a transfer from: what a decode worker reads off the prefill worker's handle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    pub addr: SocketAddr,
    pub key: TransferKey,
    /// The sender's shared KV region, if it keeps one.
    pub region: Option<String>,
}

/// Which side of a transfer an event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// This worker offered the KV.
    Sending,
    /// This worker pulled the KV.
    Receiving,
}

/// What the worker must act on.
#[derive(Debug, Clone, PartialEq)]
pub enum EndpointEvent {
    /// Receiving: the sender accepted the pull. Allocate `blocks` destination blocks under a lease for
    /// the transfer and call [`Endpoint::set_destination`], or [`Endpoint::abort`].
    Described { transfer: u64, blocks: u32, meta: PromptMeta },
    /// A transfer ended on this side. Sending: release its lease, whatever the outcome. Receiving:
    /// adopt the destination lease on `Completed`, release it otherwise.
    Ended { side: Side, transfer: u64, outcome: TransferOutcome, took_ms: u64 },
}

/// Bytes moved, for the worker's metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EndpointStats {
    /// Block bytes sent inline.
    pub bytes_sent: u64,
    /// Block bytes received inline.
    pub bytes_received: u64,
    /// Block bytes copied out of a sender's shared region.
    pub bytes_shared: u64,
    /// Inline blocks whose bytes did not match their checksum (each failed its transfer).
    pub checksum_failures: u64,
}

/// One worker's end of every transfer. See the [module docs](self).
#[derive(Debug)]
pub struct Endpoint {
    transport: Box<dyn Transport>,
    sender: Sender,
    receiver: Receiver,
    layout: Layout,
    config: EndpointConfig,
    next_epoch: u32,
    /// Receiving transfers: the connection each is pulled over, and whether its blocks are named.
    pulls: HashMap<u64, (PeerId, bool)>,
    /// When each live transfer began (caller's ms), by side.
    began: HashMap<(Side, u64), u64>,
    events: VecDeque<EndpointEvent>,
    stats: EndpointStats,
    block_buf: Vec<u8>,
    /// The latest `now` the caller gave, for the durations of transfers that end between pumps.
    now: u64,
    /// Offers the test hooks fault (`EndpointConfig::faults`).
    faulty: HashMap<u64, Fault>,
}

impl Endpoint {
    pub fn new(transport: Box<dyn Transport>, layout: Layout, config: EndpointConfig) -> Endpoint {
        Endpoint {
            transport,
            sender: Sender::new(config.sender),
            receiver: Receiver::new(config.ack_every),
            layout,
            config,
            next_epoch: config.epoch_seed,
            pulls: HashMap::new(),
            began: HashMap::new(),
            events: VecDeque::new(),
            stats: EndpointStats::default(),
            block_buf: vec![0; layout.block_bytes()],
            now: 0,
            faulty: HashMap::new(),
        }
    }

    /// What receivers need to read this side's blocks themselves, if its transport publishes it
    /// ([`Transport::region`]).
    pub fn region(&self) -> Option<String> {
        self.transport.region()
    }

    /// The address receivers pull from (the transport's listener).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.transport.local_addr()
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Transfers live on either side.
    pub fn len(&self) -> usize {
        self.sender.len() + self.receiver.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sender.is_empty() && self.receiver.is_empty()
    }

    pub fn stats(&self) -> EndpointStats {
        self.stats
    }

    /// Sending: offers `blocks` (held by the ledger's lease for `transfer`, in order) until
    /// `expires_at` (caller's ms). Returns the key a handle names.
    pub fn offer(
        &mut self,
        transfer: TransferId,
        blocks: Vec<BlockId>,
        expires_at: u64,
        meta: PromptMeta,
        now: u64,
    ) -> Result<TransferKey, TransferError> {
        self.now = now;
        self.next_epoch = self.next_epoch.wrapping_add(1);
        let key = TransferKey { transfer: transfer.0, epoch: self.next_epoch };
        let fault = self.config.faults.of(meta.prompt.len());
        self.sender.offer(key, self.layout, blocks, expires_at, meta)?;
        self.began.insert((Side::Sending, key.transfer), now);
        if let Some(f) = fault {
            self.faulty.insert(key.transfer, f);
        }
        Ok(key)
    }

    /// Receiving: connects to the sending side and asks what `source` holds; the answer comes as
    /// [`EndpointEvent::Described`]. The transfer ends by `deadline` (caller's ms) in any case.
    pub fn pull(&mut self, source: &Source, deadline: u64, now: u64) -> Result<(), TransferError> {
        self.now = now;
        if self.pulls.contains_key(&source.key.transfer) {
            return Err(TransferError::Duplicate);
        }
        if self.pulls.len() >= self.config.pulls_max {
            return Err(TransferError::TooMany { limit: self.config.pulls_max });
        }
        let c = self
            .transport
            .connect(source.addr, source.region.as_deref())
            .map_err(|error| TransferError::Connect { addr: source.addr, error })?;
        if let Err(e) = self.receiver.start(source.key, c.peer, self.layout, deadline, c.named_blocks) {
            self.transport.close(c.peer);
            return Err(e);
        }
        self.pulls.insert(source.key.transfer, (c.peer, c.named_blocks));
        self.began.insert((Side::Receiving, source.key.transfer), now);
        self.flush_receiver();
        self.transport.flush();
        Ok(())
    }

    /// Receiving: the destination blocks (block, epoch at allocation) of a described transfer, one
    /// per sender block from `from` on; the blocks before `from` this worker holds already (its prefix
    /// cache) and are not pulled. A wrong count ends the transfer.
    pub fn set_destination(
        &mut self,
        transfer: u64,
        from: u32,
        dest: Vec<(BlockId, u32)>,
    ) -> Result<(), TransferError> {
        let r = self.receiver.set_destination(transfer, from, dest);
        self.flush_receiver();
        self.settle_ended();
        self.transport.flush();
        r
    }

    /// Ends `transfer` on whichever side holds it and tells the peer. Idempotent: `false` if it had
    /// ended already.
    pub fn abort(&mut self, transfer: u64) -> bool {
        let ended = self.sender.abort(transfer) | self.receiver.abort(transfer);
        self.flush_sender_messages();
        self.flush_receiver();
        self.settle_ended();
        self.transport.flush();
        ended
    }

    /// Runs one turn: expiries at `now`, up to `wait` of transport I/O, the copies the state machines
    /// ask for, and what they want sent. `kv` is this worker's ledger: a block is read only while the
    /// offer's lease holds it and written only where the pull's lease allows.
    pub fn pump(
        &mut self,
        kv: &dyn Ledger,
        memory: &mut dyn BlockMemory,
        now: u64,
        wait: Duration,
    ) -> io::Result<()> {
        self.now = now;
        self.sender.handle_timeout(now);
        self.receiver.handle_timeout(now);
        let Endpoint { transport, sender, receiver, pulls, stats, faulty, .. } = self;
        let mut on = |a: Arrival<'_>| match a {
            Arrival::Message { peer, msg } => {
                let t = msg.key().transfer;
                if pulls.get(&t).is_some_and(|&(p, _)| p == peer) {
                    if let Message::BlockAt { .. } = msg {
                        // A named block this side cannot read: never trust the transfer.
                        receiver.abort(t);
                    } else {
                        receiver.handle_message(peer, msg);
                    }
                    return;
                }
                if matches!(msg, Message::Done { .. }) && faulty.get(&t) == Some(&Fault::DropDone) {
                    return; // the test hook: this notice is lost on the way
                }
                // The ledger's lease is the ground truth: no `Confirm` for blocks it has freed (a
                // `Ready` may complete a transfer whose blocks the receiver holds already).
                if let Message::Done { key } | Message::Ready { key, .. } = &msg {
                    if !kv.leased(TransferId(key.transfer)) {
                        sender.abort(key.transfer);
                    }
                }
                sender.handle_message(peer, msg);
            }
            Arrival::Block { peer, key, index, data, crc } => {
                let Some(dst) = receiver.accept_block(peer, key, index, data.len()) else { return };
                if !kv.may_write(TransferId(key.transfer), dst.block, dst.block_epoch) {
                    return; // a late or foreign block: never written
                }
                // Stored and checked in one pass where the memory lends the block: a corrupted one
                // fails the transfer, whose blocks are then released, never adopted, so nothing is
                // ever decoded from these bytes.
                let written = match crc.filter(|&c| c != 0) {
                    None => memory.write_block(dst.block, data).map(|()| true),
                    Some(c) => memory
                        .write_block_striped(dst.block, data)
                        .map(|d| crate::checksum::checksum_of_digest(key, index, d) == c),
                };
                match written {
                    Err(_) => {
                        receiver.abort(key.transfer);
                        return;
                    }
                    Ok(false) => {
                        // Corrupted on the way.
                        stats.checksum_failures += 1;
                        receiver.fail(key.transfer, crate::FailReason::Checksum);
                        return;
                    }
                    Ok(true) => {}
                }
                let named = pulls.get(&key.transfer).is_some_and(|&(_, n)| n);
                if named {
                    stats.bytes_shared += data.len() as u64;
                } else {
                    stats.bytes_received += data.len() as u64;
                }
                receiver.block_written(key, index);
            }
            Arrival::Lost { peer } => {
                sender.handle_peer_lost(peer);
                receiver.handle_peer_lost(peer);
            }
        };
        let polled = transport.poll(wait, &mut on);
        self.flush_sender(kv, memory);
        self.flush_receiver();
        self.settle_ended();
        // What this turn queued (every `BlockAt` of a pull, say) goes out in one write per peer.
        self.transport.flush();
        polled
    }

    /// The next thing the worker must act on.
    pub fn poll_event(&mut self) -> Option<EndpointEvent> {
        self.events.pop_front()
    }

    fn flush_sender_messages(&mut self) {
        // Only messages can be queued outside a pump (an abort); blocks wait for the next pump.
        let mut blocks = Vec::new();
        while let Some(a) = self.sender.poll_action() {
            match a {
                SendAction::Message { peer, msg } => self.transport.send(peer, &msg, &[]),
                block => blocks.push(block),
            }
        }
        debug_assert!(blocks.is_empty(), "blocks are only sent from pump");
    }

    fn flush_sender(&mut self, kv: &dyn Ledger, memory: &dyn BlockMemory) {
        while let Some(a) = self.sender.poll_action() {
            match a {
                SendAction::Message { peer, msg } => self.transport.send(peer, &msg, &[]),
                SendAction::Block { key, .. } if self.faulty.get(&key.transfer) == Some(&Fault::Stalled) => {
                    // The test hook: stuck after the first block, the connection left open.
                }
                SendAction::Block { peer, key, index, block, shared } => {
                    if let Some(f @ Fault::Stall) = self.faulty.get_mut(&key.transfer) {
                        *f = Fault::Stalled;
                    }
                    // Read only a block the offer's lease still holds.
                    let held = kv.holds(TransferId(key.transfer), block);
                    if !held {
                        self.sender.abort(key.transfer);
                        continue;
                    }
                    // The block's checksum (a named one's too: the receiver reads those bytes out of
                    // shared memory or over UCX, and checks them before they reach its KV memory).
                    let checksums = self.config.checksums;
                    let lent = memory.block(block, self.block_buf.len());
                    let crc = match (shared, lent) {
                        // Named: checksummed where it lies (or from a copy, memory that lends none).
                        (true, _) if !checksums => 0,
                        (true, Some(bytes)) => crate::checksum::block_checksum(key, index, bytes),
                        // Inline from memory that lends it: copied and checksummed in one pass.
                        (false, Some(bytes)) => {
                            let digest = crate::checksum::copy_striped(&mut self.block_buf, bytes);
                            if checksums {
                                crate::checksum::checksum_of_digest(key, index, digest)
                            } else {
                                0
                            }
                        }
                        (_, None) => {
                            if memory.read_block(block, &mut self.block_buf).is_err() {
                                self.sender.abort(key.transfer);
                                continue;
                            }
                            if checksums {
                                crate::checksum::block_checksum(key, index, &self.block_buf)
                            } else {
                                0
                            }
                        }
                    };
                    if shared {
                        self.transport.send(peer, &Message::BlockAt { key, index, slot: block.0, crc }, &[]);
                        continue;
                    }
                    let msg = Message::Block { key, index, len: self.block_buf.len() as u32, crc };
                    self.transport.send(peer, &msg, &self.block_buf);
                    self.stats.bytes_sent += self.block_buf.len() as u64;
                }
            }
        }
    }

    fn flush_receiver(&mut self) {
        while let Some((peer, msg)) = self.receiver.poll_transmit() {
            self.transport.send(peer, &msg, &[]);
        }
        while let Some(d) = self.receiver.poll_described() {
            self.events.push_back(EndpointEvent::Described {
                transfer: d.key.transfer,
                blocks: d.blocks,
                meta: d.meta,
            });
        }
    }

    /// Turns the state machines' endings into events, closing the connection of each ended pull.
    fn settle_ended(&mut self) {
        while let Some(e) = self.sender.poll_event() {
            self.faulty.remove(&e.key.transfer);
            let began = self.began.remove(&(Side::Sending, e.key.transfer));
            self.events.push_back(EndpointEvent::Ended {
                side: Side::Sending,
                transfer: e.key.transfer,
                outcome: e.outcome,
                took_ms: began.map_or(0, |b| self.now.saturating_sub(b)),
            });
        }
        while let Some(e) = self.receiver.poll_event() {
            // What the receiver queued for the peer (an Abort, a Done) goes out before the close.
            while let Some((peer, msg)) = self.receiver.poll_transmit() {
                self.transport.send(peer, &msg, &[]);
            }
            if let Some((peer, _)) = self.pulls.remove(&e.key.transfer) {
                self.transport.close(peer);
            }
            let began = self.began.remove(&(Side::Receiving, e.key.transfer));
            self.events.push_back(EndpointEvent::Ended {
                side: Side::Receiving,
                transfer: e.key.transfer,
                outcome: e.outcome,
                took_ms: began.map_or(0, |b| self.now.saturating_sub(b)),
            });
        }
    }
}
