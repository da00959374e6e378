//! Moving a request's KV blocks from a prefill worker to a decode worker without ever stranding them,
//! in three layers a program can take separately:
//!
//! - the protocol: a *pull* protocol as sans-IO state machines, [`Sender`] (prefill side) and
//!   [`Receiver`] (decode side), that take messages and `now` and give back messages to send and
//!   events, with length-prefixed binary framing ([`encode`], [`decode`]). Block bytes never pass
//!   through them;
//! - [`transport`]: the [`Transport`] trait, the one seam for ways of moving frames and block bytes,
//!   with [`TcpTransport`] (frames and block bytes over TCP) and [`SharedMemoryTransport`] (frames over
//!   TCP; a same-host receiver copies named blocks straight out of the sender's shared region,
//!   [`transport::shm`]);
//! - [`Endpoint`]: one worker's end of every transfer, driving both state machines over a transport and
//!   copying each block between the transport and the worker's KV memory ([`BlockMemory`]) only where
//!   the worker's KV ledger (`pdserve_kvcache::KvCache`: the lease, block id and epoch) allows it.
//!
//! ```text
//!  decode (Receiver)                               prefill (Sender)
//!                                                  lease_sequence(seq, T) after the first token
//!  start(T.e, peer, layout) ── Pull{T.e, layout} ──▶ offer(T.e, layout, blocks, expiry, prompt meta)
//!                          ◀── Accept{T.e, n, meta}   (layout checked: mismatch → Reject)
//!  Described: allocate_lease_reusing(T, prompt, n)    meta: prompt token ids, first token, logprobs
//!  set_destination(T, f, dest) ── Ready{T.e, from f} ─▶ blocks before f: in the decode side's own
//!                                                      prefix cache already, never sent
//!  accept_block → check_write → ◀── Block{T.e, i, bytes} ── window of W blocks in flight
//!  copy → block_written        ─── Ack{T.e, written} ──▶ more blocks
//!  after the last block        ─── Done{T.e} ──────────▶ lease still held? Completed → release_lease(T)
//!  Completed → adopt_lease(T, seq) ◀── Confirm{T.e} ───   (not held: Reject, and the receiver fails)
//!
//!  Same host: Pull{.., shared: true} and a sender whose KV memory is a shared region → the sender names
//!  each block (BlockAt{T.e, i, slot}) and the receiver copies it straight out of the region. The
//!  Confirm proves the lease held from the offer until after every copy, so a block freed and reused
//!  mid-transfer can never be trusted.
//!
//!  Either side, any time: Abort{T.e, reason} ───▶ the other side ends T with that reason.
//!  Deadlines: the sender's lease expiry (LeaseExpired) and the receiver's data deadline (DataTimeout)
//!  each end T on their side and send Abort to the other. A message whose transfer has ended, or whose
//!  epoch differs, is dropped without touching any block.
//! ```
//!
//! Each transfer ends exactly once on each side with an [`TransferOutcome`] in a [`TransferEvent`]; the shell
//! then releases (sender) or adopts or releases (receiver) its kvcache lease, so both KV ledgers return
//! to baseline.

mod checksum;
mod endpoint;
mod error;
mod message;
mod receiver;
mod sender;
mod sys;
pub mod transport;

pub use checksum::{block_checksum, checksum_of_digest, copy_striped, crc32c, striped};
pub use endpoint::{
    BlockMemory, Endpoint, EndpointConfig, EndpointEvent, EndpointStats, Ledger, SenderFaults, Side, Source,
};
pub use error::TransferError;
pub use message::{
    decode, encode, Dtype, FailReason, Frame, Layout, Message, PromptMeta, TransferKey, FIRST_TOP_MAX,
    FRAME_BYTES_MAX, PROMPT_TOKENS_MAX,
};
pub use receiver::{Described, Destination, Receiver};
pub use sender::{SendAction, Sender, SenderConfig};
#[cfg(feature = "ucx")]
pub use transport::UcxTransport;
pub use transport::{Arrival, Connected, SharedMemoryTransport, TcpTransport, Transport};

/// The I/O shell's name for a connection to a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u64);

/// How a transfer ended on one side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferOutcome {
    Completed,
    Failed(FailReason),
}

/// A transfer ended on this side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferEvent {
    pub key: TransferKey,
    pub outcome: TransferOutcome,
}

/// The README's examples, compiled and run as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
