use std::fmt;

use crate::{BlockId, SeqId, TransferId};

/// Why a KV operation was refused. Operating conditions only; broken invariants are assertions.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KvError {
    /// Not enough blocks, even after evicting every evictable cached block. Nothing was allocated.
    OutOfBlocks {
        needed_blocks: usize,
        free_blocks: usize,
    },
    /// The configuration cannot describe a pool (zero blocks or a zero block size).
    InvalidConfig {
        num_blocks: u32,
        block_size: u32,
    },
    UnknownSequence {
        seq: SeqId,
    },
    DuplicateSequence {
        seq: SeqId,
    },
    UnknownTransfer {
        transfer: TransferId,
    },
    DuplicateTransfer {
        transfer: TransferId,
    },
    /// A commit or read past what the sequence has: `requested` tokens, `limit` available.
    OutOfRange {
        seq: SeqId,
        requested: usize,
        limit: usize,
    },
    /// A commit would write into blocks that `reserve` did not prepare (missing or shared with others).
    NotReserved {
        seq: SeqId,
    },
    /// A lease has fewer blocks than the tokens handed to it need.
    LeaseTooSmall {
        transfer: TransferId,
        blocks: usize,
        needed_blocks: usize,
    },
    /// The operation needs KV that the sequence released (outside its sliding window).
    Released {
        seq: SeqId,
        block_index: usize,
    },
    /// Every state slot is held by a live request (restore points were evicted to make room).
    OutOfStates {
        slots: usize,
    },
    /// A stateful model's request cannot be cut back below what it computed: its state (a window's
    /// ring, a compressor's partial group) has moved past that point.
    StateRewind {
        seq: SeqId,
        computed: usize,
        requested: usize,
    },
    /// A write of a request's state for a transfer that no longer holds that slot at that epoch.
    StaleStateWrite {
        transfer: TransferId,
        state: u32,
        epoch: u32,
    },
    /// A write for a block this transfer no longer holds at that epoch.
    StaleWrite {
        transfer: TransferId,
        block: BlockId,
        epoch: u32,
    },
}

impl fmt::Display for KvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvError::OutOfBlocks { needed_blocks, free_blocks } => {
                write!(f, "out of KV blocks: need {needed_blocks}, {free_blocks} free")
            }
            KvError::InvalidConfig { num_blocks, block_size } => {
                write!(f, "invalid KV pool: {num_blocks} blocks of {block_size} tokens")
            }
            KvError::UnknownSequence { seq } => write!(f, "unknown {seq}"),
            KvError::DuplicateSequence { seq } => write!(f, "{seq} already exists"),
            KvError::UnknownTransfer { transfer } => write!(f, "unknown {transfer}"),
            KvError::DuplicateTransfer { transfer } => write!(f, "{transfer} already holds a lease"),
            KvError::OutOfRange { seq, requested, limit } => {
                write!(f, "{seq}: {requested} tokens requested, {limit} available")
            }
            KvError::NotReserved { seq } => write!(f, "{seq}: commit without a reserve covering it"),
            KvError::LeaseTooSmall { transfer, blocks, needed_blocks } => {
                write!(f, "{transfer} holds {blocks} blocks, {needed_blocks} needed")
            }
            KvError::Released { seq, block_index } => {
                write!(f, "{seq}: block {block_index} was released (outside the sliding window)")
            }
            KvError::OutOfStates { slots } => write!(f, "all {slots} request state slots are in use"),
            KvError::StateRewind { seq, computed, requested } => {
                write!(f, "{seq}: cannot cut back to {requested} tokens: its state has computed {computed}")
            }
            KvError::StaleStateWrite { transfer, state, epoch } => {
                write!(f, "{transfer}: stale write to state slot {state} at epoch {epoch}")
            }
            KvError::StaleWrite { transfer, block, epoch } => {
                write!(f, "{transfer}: stale write to {block} at epoch {epoch}")
            }
        }
    }
}

impl std::error::Error for KvError {}
