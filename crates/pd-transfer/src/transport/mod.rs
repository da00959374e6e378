//! How frames and block bytes move between the two workers: the [`Transport`] trait, the seam every
//! way of moving KV plugs into, and its implementations: [`TcpTransport`] (frames and block bytes over
//! TCP), [`SharedMemoryTransport`] (frames over TCP, block bytes read straight out of a same-host
//! sender's shared region, [`shm`]) and, with the `ucx` feature, `UcxTransport` (frames over TCP,
//! block bytes read with UCX one-sided gets out of the sender's registered region: RDMA, shared
//! memory or TCP, whichever UCX finds).
//!
//! A transport knows nothing of the protocol's rules: it carries [`Message`]s, hands every arrival to
//! its caller (a block with its bytes, wherever they were read from), and reports peers it lost. A
//! one-sided-read transport publishes what a reader needs ([`Transport::region`], carried in the
//! transfer handle), `connect` learns the sender's registration from it, a `BlockAt` names a slot,
//! and `poll` hands over the bytes it read.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use crate::{Message, PeerId, TransferKey};

mod shared_memory;
pub mod shm;
mod tcp;
#[cfg(feature = "ucx")]
mod ucx;

pub use shared_memory::SharedMemoryTransport;
pub use tcp::TcpTransport;
#[cfg(feature = "ucx")]
pub use ucx::{UcxTransport, REGION_PREFIX as UCX_REGION_PREFIX};

/// What arrived from a peer.
#[derive(Debug)]
pub enum Arrival<'a> {
    /// A control message (anything but a block).
    Message { peer: PeerId, msg: Message },
    /// Block `index` of `key`: its bytes, sent inline (with the CRC-32C the sender computed, which
    /// the endpoint checks before the bytes reach KV memory) or read from the sender's memory
    /// (`crc: None`).
    Block { peer: PeerId, key: TransferKey, index: u32, data: &'a [u8], crc: Option<u32> },
    /// The connection to `peer` is gone (closed, reset, or it sent garbage).
    Lost { peer: PeerId },
}

/// A connection to a sending side, as [`Transport::connect`] opened it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Connected {
    pub peer: PeerId,
    /// The sender's blocks can be named rather than sent: this side reads them from the sender's
    /// memory (a shared region on this host).
    pub named_blocks: bool,
}

/// Moves frames between the workers of a transfer.
pub trait Transport: Send + std::fmt::Debug {
    /// The address receivers connect to (the sending side's listener), if this side listens.
    fn local_addr(&self) -> Option<SocketAddr>;

    /// What a receiver needs to read this side's blocks itself, if this transport publishes it (a
    /// UCX worker address and memory key); it travels in the transfer handle.
    fn region(&self) -> Option<String> {
        None
    }

    /// Opens a connection to the sending side at `addr`. `region` is the sender's shared KV region, as
    /// its handle names it; the transport reads named blocks from it if it can reach it.
    fn connect(&mut self, addr: SocketAddr, region: Option<&str>) -> io::Result<Connected>;

    /// Queues `msg` (with `data`, the bytes of a `Block`) for `peer`; it is written by the next
    /// [`flush`](Self::flush) or [`poll`](Self::poll), or now if enough is queued. A peer that is
    /// gone is reported by the next `poll`.
    fn send(&mut self, peer: PeerId, msg: &Message, data: &[u8]);

    /// Writes what [`send`](Self::send) queued, as far as the connections take it now. The endpoint
    /// calls it at the end of every call that may have sent, so the frames of one turn (a pull's
    /// hundreds of `BlockAt`, a receiver's acknowledgements) go out in one write, not one each. A
    /// transport that wraps another forwards it (else frames wait for the next `poll`).
    fn flush(&mut self);

    /// Closes the connection to `peer` after a best-effort write of what is queued.
    fn close(&mut self, peer: PeerId);

    /// Waits up to `wait` for I/O, then hands every arrival to `on`, in order per peer.
    fn poll(&mut self, wait: Duration, on: &mut dyn FnMut(Arrival<'_>)) -> io::Result<()>;
}
