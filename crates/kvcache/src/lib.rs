//! Paged KV cache bookkeeping: a fixed pool of blocks, per-sequence block tables, a prefix cache, and
//! transfer leases, tied together by an ownership ledger whose leaks are countable.
//!
//! [`KvCache`] manages block *ids* only; the memory holding K and V belongs to the model backend, which
//! indexes it by [`BlockId`]. Every block is, at any moment, free or owned by exactly one
//! [`OwnerKind`] (a sequence, the prefix cache, or a transfer lease), and `free + owned == total`.
//! Sans-IO: no threads, no clock (lease expiry takes `now` in the caller's unit), no I/O.
//!
//! ```
//! use pdserve_kvcache::{KvCache, KvConfig, SeqId, OwnerKind};
//! let mut kv = KvCache::new(KvConfig { num_blocks: 64, block_size: 4 }).unwrap();
//! let prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9];
//! let hit = kv.add_sequence(SeqId(1), &prompt).unwrap();
//! assert_eq!(hit.cached_tokens, 0);
//! kv.reserve(SeqId(1), prompt.len()).unwrap();    // 3 blocks for 9 tokens
//! kv.commit(SeqId(1), prompt.len()).unwrap();     // the forward pass wrote their KV
//! kv.free_sequence(SeqId(1), true).unwrap();      // 2 full blocks stay in the prefix cache
//! assert_eq!(kv.stats().owned(OwnerKind::Cache), 2);
//! // The same prompt again reuses them.
//! assert_eq!(kv.add_sequence(SeqId(2), &prompt).unwrap().cached_tokens, 8);
//! kv.check_invariants().unwrap();
//! ```
#![forbid(unsafe_code)]

mod cache;
mod check;
mod error;
mod group_leases;
mod group_ops;
mod groups;
mod ids;
mod lease;
mod prefix;
#[doc(hidden)]
pub mod sim;
#[doc(hidden)]
pub mod sim_groups;
mod tier;

pub use cache::{BlockCopy, CacheEvent, KvCache, KvConfig, KvStats, LeaseView, PrefixHit};
pub use error::KvError;
pub use groups::{
    GroupHit, GroupLease, GroupSpec, GroupsConfig, KvGroups, LayerKind, StateCopy, StateId, StateStats,
};
pub(crate) use ids::NodeId;
pub use ids::{BlockId, OwnerKind, SeqId, Slot, TransferId};
pub use prefix::{IdHasher, IdMap};
pub use tier::{Medium, TierConfig, TierCopy, TierSlot, TierStats};

/// The README's examples, compiled and run as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
