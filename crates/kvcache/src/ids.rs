//! Newtype ids. Tokens are plain `u32`.

use std::fmt;

/// Index of a KV block in the pool, `0..num_blocks`. The backend stores block `b`'s keys and values at
/// its own offset for `b`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

impl BlockId {
    /// Stands in a block table for a block the sequence gave back because no position it will
    /// compute attends to it any more (a sliding window, see `KvCache::release_outside_window`).
    /// Never a pool index: a pool of `u32::MAX` blocks is refused.
    pub const RELEASED: BlockId = BlockId(u32::MAX);

    /// Whether this is [`RELEASED`](Self::RELEASED).
    pub fn is_released(self) -> bool {
        self == BlockId::RELEASED
    }
}

/// A sequence (one request's token stream, or one branch of a parallel-sampling fork), named by the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

/// A KV transfer between workers, named by the caller; owns blocks under a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferId(pub u64);

/// A node of the prefix tree's arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct NodeId(pub(crate) u32);

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "block {}", self.0)
    }
}

impl fmt::Display for SeqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seq {}", self.0)
    }
}

impl fmt::Display for TransferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "transfer {}", self.0)
    }
}

/// Where one token's K and V live: a block and the position inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Slot {
    pub block: BlockId,
    pub offset: u32,
}

impl Slot {
    /// The flat slot index `block * block_size + offset` that attention kernels take.
    pub fn index(self, block_size: usize) -> usize {
        self.block.0 as usize * block_size + self.offset as usize
    }
}

/// Who holds a block. A block referenced by any sequence is `Sequence`; else by any lease, `Transfer`;
/// else, if the prefix cache indexes it, `Cache`; else it is free.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OwnerKind {
    Sequence,
    Cache,
    Transfer,
}

impl OwnerKind {
    pub const ALL: [OwnerKind; 3] = [OwnerKind::Sequence, OwnerKind::Cache, OwnerKind::Transfer];

    /// The label value used in metrics (`kv_blocks_owned{owner="sequence"}`).
    pub fn as_str(self) -> &'static str {
        match self {
            OwnerKind::Sequence => "sequence",
            OwnerKind::Cache => "cache",
            OwnerKind::Transfer => "transfer",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}
