//! The offload tier: where the prefix cache's evicted blocks go instead of being forgotten, and where a
//! later prompt finds them again. Slots `0..host_blocks` are host memory beyond the pool, the rest
//! files; each holds one block's KV, keyed by the block's chain hash (its whole prefix), with the
//! parent's chain hash and the block's tokens to verify a match. Bookkeeping only, like the pool: the
//! KV moves by the [`TierCopy`]s the cache records, which whoever holds the memory performs, in order,
//! before the next step.
//!
//! A pool block evicted goes to a free host slot; with host memory full, its least recently used
//! entry moves down to a disk slot first (and with the disk full, the disk's least recently used entry
//! is dropped); without disk slots, the host's least recently used entry is dropped. A match takes the
//! entry out of the tier: its KV goes back into a pool block, which the prefix cache holds again.

use std::collections::BTreeSet;

use crate::cache::{CacheEvent, KvCache};
use crate::prefix::{chain_hash, hash_tokens, IdMap, ROOT, ROOT_CHAIN};
use crate::BlockId;

/// Where a block's KV lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Medium {
    /// The pool the backend computes from.
    Pool,
    /// Host memory beyond the pool.
    Host,
    /// Files.
    Disk,
}

impl Medium {
    /// The name vLLM's KV events give the medium (`GPU` for the primary pool, on any device).
    pub fn as_str(self) -> &'static str {
        match self {
            Medium::Pool => "GPU",
            Medium::Host => "CPU",
            Medium::Disk => "DISK",
        }
    }
}

/// The offload tier's size, in blocks (each `block_bytes` of the backend's layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TierConfig {
    pub host_blocks: u32,
    pub disk_blocks: u32,
}

/// A slot of the offload tier: `0..host_blocks` in host memory, then `disk_blocks` on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TierSlot(pub u32);

/// A copy of one block's KV, for whoever holds the memory to perform before the next step, in the
/// order recorded ([`KvCache::take_tier_copies`](crate::KvCache::take_tier_copies)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TierCopy {
    /// An evicted pool block into a slot (before anything writes the block again).
    Out { block: BlockId, slot: TierSlot },
    /// A host slot's block down to a disk slot (host memory full).
    Down { from: TierSlot, to: TierSlot },
    /// A slot's block into a pool block (a prefix match in the tier), before a step reads it.
    In { slot: TierSlot, block: BlockId },
}

/// What the tier holds and has done, for `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TierStats {
    pub host_blocks_total: usize,
    pub disk_blocks_total: usize,
    pub host_blocks_used: usize,
    pub disk_blocks_used: usize,
    /// Pool blocks copied out on eviction.
    pub offloaded_blocks_total: u64,
    /// Host blocks moved down to disk.
    pub demoted_blocks_total: u64,
    /// Blocks copied back into the pool on a match (each spared the prompt's recomputation).
    pub restored_blocks_total: u64,
    /// Blocks the tier forgot for room.
    pub dropped_blocks_total: u64,
}

#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) slot: TierSlot,
    /// The parent block's chain hash (the root's for a prompt's first block).
    pub(crate) parent: u64,
    pub(crate) tokens: Box<[u32]>,
    pub(crate) last_use: u64,
}

/// A change the tier made, for the cache's event log: stored in or removed from a medium.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TierEvent {
    Stored { hash: u64, parent: u64, tokens: Vec<u32>, medium: Medium },
    Removed { hash: u64, medium: Medium },
}

#[derive(Debug)]
pub(crate) struct Tier {
    pub(crate) config: TierConfig,
    /// chain hash -> entry
    pub(crate) entries: IdMap<u64, Entry>,
    /// Per medium (host, disk): (last use, chain hash), least recent first.
    pub(crate) lru: [BTreeSet<(u64, u64)>; 2],
    pub(crate) free: [Vec<TierSlot>; 2],
    tick: u64,
    pub(crate) stats: TierStats,
}

fn level(m: Medium) -> usize {
    usize::from(m == Medium::Disk)
}

impl Tier {
    pub(crate) fn new(config: TierConfig) -> Tier {
        let (h, d) = (config.host_blocks, config.disk_blocks);
        Tier {
            config,
            entries: IdMap::default(),
            lru: [BTreeSet::new(), BTreeSet::new()],
            // Reversed: slots come off in ascending order.
            free: [(0..h).rev().map(TierSlot).collect(), (h..h + d).rev().map(TierSlot).collect()],
            tick: 0,
            stats: TierStats {
                host_blocks_total: h as usize,
                disk_blocks_total: d as usize,
                ..TierStats::default()
            },
        }
    }

    pub(crate) fn medium(&self, slot: TierSlot) -> Medium {
        if slot.0 < self.config.host_blocks {
            Medium::Host
        } else {
            Medium::Disk
        }
    }

    pub(crate) fn stats(&self) -> TierStats {
        TierStats {
            host_blocks_used: self.config.host_blocks as usize - self.free[0].len(),
            disk_blocks_used: self.config.disk_blocks as usize - self.free[1].len(),
            ..self.stats
        }
    }

    /// The entry for `chain` if it is the block of `tokens` under `parent`.
    pub(crate) fn holds(&self, chain: u64, parent: u64, tokens: &[u32]) -> bool {
        self.entries.get(&chain).is_some_and(|e| e.parent == parent && *e.tokens == *tokens)
    }

    fn unlink(&mut self, chain: u64) -> Option<Entry> {
        let e = self.entries.remove(&chain)?;
        let m = self.medium(e.slot);
        self.lru[level(m)].remove(&(e.last_use, chain));
        Some(e)
    }

    fn link(&mut self, chain: u64, mut e: Entry) {
        self.tick += 1;
        e.last_use = self.tick;
        let m = self.medium(e.slot);
        self.lru[level(m)].insert((e.last_use, chain));
        self.entries.insert(chain, e);
    }

    /// Forgets `level`'s least recently used entry; its slot is free again.
    fn drop_lru(&mut self, lv: usize, events: &mut Vec<TierEvent>) -> bool {
        let Some(&(_, chain)) = self.lru[lv].first() else { return false };
        let Some(e) = self.unlink(chain) else { return false };
        events.push(TierEvent::Removed { hash: chain, medium: self.medium(e.slot) });
        self.free[lv].push(e.slot);
        self.stats.dropped_blocks_total += 1;
        true
    }

    /// A free slot for a block leaving the pool: host memory first, making room by moving its least
    /// recently used entry down to disk (or dropping it without disk slots); then disk. `None` with no
    /// slots at all.
    fn slot_for_out(&mut self, copies: &mut Vec<TierCopy>, events: &mut Vec<TierEvent>) -> Option<TierSlot> {
        let (h, d) = (self.config.host_blocks, self.config.disk_blocks);
        if h > 0 {
            if self.free[0].is_empty() {
                if d > 0 {
                    if self.free[1].is_empty() {
                        self.drop_lru(1, events);
                    }
                    let &(_, chain) = self.lru[0].first()?;
                    let to = self.free[1].pop()?;
                    let mut e = self.unlink(chain)?;
                    let from = e.slot;
                    copies.push(TierCopy::Down { from, to });
                    events.push(TierEvent::Removed { hash: chain, medium: Medium::Host });
                    let (parent, tokens) = (e.parent, e.tokens.to_vec());
                    events.push(TierEvent::Stored { hash: chain, parent, tokens, medium: Medium::Disk });
                    e.slot = to;
                    self.link(chain, e);
                    self.free[0].push(from);
                    self.stats.demoted_blocks_total += 1;
                } else {
                    self.drop_lru(0, events);
                }
            }
            return self.free[0].pop();
        }
        if d > 0 && self.free[1].is_empty() {
            self.drop_lru(1, events);
        }
        self.free[1].pop()
    }

    /// Keeps an evicted pool block: records its copy out. A block the tier holds already (computed
    /// again while its copy was here) is only marked as used.
    pub(crate) fn put(
        &mut self,
        (chain, parent, tokens): (u64, u64, &[u32]),
        block: BlockId,
        copies: &mut Vec<TierCopy>,
        events: &mut Vec<TierEvent>,
    ) {
        if let Some(e) = self.unlink(chain) {
            return self.link(chain, e);
        }
        let Some(slot) = self.slot_for_out(copies, events) else { return };
        copies.push(TierCopy::Out { block, slot });
        let medium = self.medium(slot);
        events.push(TierEvent::Stored { hash: chain, parent, tokens: tokens.to_vec(), medium });
        self.stats.offloaded_blocks_total += 1;
        self.link(chain, Entry { slot, parent, tokens: tokens.into(), last_use: 0 });
    }

    /// Takes the entry for `chain` out of the tier (checked with [`holds`](Self::holds) first): its slot,
    /// which stays taken until [`release`](Self::release), after the copy into the pool is recorded.
    pub(crate) fn take(&mut self, chain: u64, events: &mut Vec<TierEvent>) -> Option<TierSlot> {
        let e = self.unlink(chain)?;
        events.push(TierEvent::Removed { hash: chain, medium: self.medium(e.slot) });
        Some(e.slot)
    }

    /// A taken slot is free again (its copy into the pool is recorded before any copy into it).
    pub(crate) fn release(&mut self, slot: TierSlot) {
        let lv = level(self.medium(slot));
        self.free[lv].push(slot);
    }

    /// Recomputes the tier's bookkeeping from its entries: `Err` names the first violation.
    pub(crate) fn check(&self) -> Result<(), String> {
        let total = (self.config.host_blocks + self.config.disk_blocks) as usize;
        let mut seen = vec![false; total];
        for s in self.free.iter().flatten() {
            if s.0 as usize >= total || std::mem::replace(&mut seen[s.0 as usize], true) {
                return Err(format!("tier slot {} free twice or out of range", s.0));
            }
        }
        for lv in 0..2 {
            if self.free[lv].iter().any(|s| level(self.medium(*s)) != lv) {
                return Err("a tier slot is on the other medium's free list".into());
            }
        }
        let mut in_lru = [0usize; 2];
        for (chain, e) in &self.entries {
            let lv = level(self.medium(e.slot));
            if e.slot.0 as usize >= total || std::mem::replace(&mut seen[e.slot.0 as usize], true) {
                return Err(format!("tier slot {} held twice, or held and free", e.slot.0));
            }
            if !self.lru[lv].contains(&(e.last_use, *chain)) {
                return Err(format!("tier entry {chain:#x} is not in its medium's LRU set"));
            }
            in_lru[lv] += 1;
        }
        if in_lru[0] != self.lru[0].len() || in_lru[1] != self.lru[1].len() {
            return Err("the tier's LRU sets hold stray entries".into());
        }
        // Slots taken for a restore are released within the call that took them.
        if seen.iter().any(|s| !s) {
            return Err("a tier slot is neither free nor held".into());
        }
        Ok(())
    }
}

impl From<TierEvent> for CacheEvent {
    fn from(e: TierEvent) -> CacheEvent {
        match e {
            TierEvent::Stored { hash, parent, tokens, medium } => {
                CacheEvent::Stored { hash, parent: (parent != ROOT_CHAIN).then_some(parent), tokens, medium }
            }
            TierEvent::Removed { hash, medium } => CacheEvent::Removed { hash, medium },
        }
    }
}

/// The cache's side of the tier.
impl KvCache {
    /// From now on, blocks the prefix cache evicts go to an offload tier of `config`'s size instead of
    /// being forgotten, and a prompt whose next blocks are there gets them back
    /// ([`add_sequence`](Self::add_sequence)). The KV moves by the copies
    /// [`take_tier_copies`](Self::take_tier_copies) returns, which must be performed, in order, before
    /// the next step (and before anything else writes a pool block). A tier of 0 blocks is none.
    pub fn enable_tier(&mut self, config: TierConfig) {
        self.tier = (config.host_blocks + config.disk_blocks > 0).then(|| Tier::new(config));
    }

    /// Gives up the offload tier after its copies failed: the tier, its pending copies and every cached
    /// block no sequence or lease holds (restored ones among them, whose KV may never have arrived)
    /// go; later prompts compute them again.
    pub fn drop_tier(&mut self) {
        self.tier = None;
        self.tier_copies.clear();
        self.tier_events.clear();
        self.evict(usize::MAX);
    }

    /// The copies between the pool and the offload tier since the last call, in order.
    pub fn take_tier_copies(&mut self) -> Vec<TierCopy> {
        std::mem::take(&mut self.tier_copies)
    }

    /// The offload tier's figures (all zero without one).
    pub fn tier_stats(&self) -> TierStats {
        self.tier.as_ref().map(Tier::stats).unwrap_or_default()
    }

    /// Moves what the tier did into the event log.
    pub(crate) fn record_tier_events(&mut self) {
        for e in std::mem::take(&mut self.tier_events) {
            self.record(|| e.into());
        }
    }

    /// The prompt's blocks after `blocks` (which end at tree node `cur`) that the offload tier holds,
    /// back into pool blocks the prefix cache holds again, referenced for the sequence (appended to
    /// `blocks`): as far as the tier's chain goes and the pool has room.
    pub(crate) fn restore(
        &mut self,
        prompt: &[u32],
        full: usize,
        mut cur: crate::NodeId,
        blocks: &mut Vec<BlockId>,
    ) {
        let bs = self.block_size();
        let mut chain = self.tree.node(cur).chain;
        for block in prompt.chunks_exact(bs).take(full).skip(blocks.len()) {
            let next = chain_hash(chain, hash_tokens(block));
            let Some(t) = self.tier.as_mut() else { return };
            // Room first: a block that cannot be had ends the restore with the entry still in the tier.
            if !t.holds(next, chain, block) || (self.free.is_empty() && self.tree.lru_victim().is_none()) {
                return;
            }
            let Some(slot) = t.take(next, &mut self.tier_events) else { return };
            // (Evicting for room may send other blocks to the tier, never into the slot just taken.)
            if self.ensure_free(1).is_err() {
                if let Some(t) = self.tier.as_mut() {
                    t.release(slot);
                    t.stats.dropped_blocks_total += 1;
                }
                self.record_tier_events();
                return;
            }
            let b = self.alloc_for_seq();
            let Some(n) = self.tree.insert(cur, block, b) else {
                // A chain hash collision in the tree: the block is computed instead.
                self.retag(b, |m| m.seq_refs -= 1);
                if let Some(t) = self.tier.as_mut() {
                    t.release(slot);
                    t.stats.dropped_blocks_total += 1;
                }
                self.record_tier_events();
                return;
            };
            self.retag(b, |m| m.node = Some(n));
            self.tier_copies.push(TierCopy::In { slot, block: b });
            if let Some(t) = self.tier.as_mut() {
                t.release(slot);
                t.stats.restored_blocks_total += 1;
            }
            let parent = (cur != ROOT).then(|| self.tree.node(cur).chain);
            self.record_tier_events();
            self.record(|| CacheEvent::Stored {
                hash: next,
                parent,
                tokens: block.to_vec(),
                medium: Medium::Pool,
            });
            blocks.push(b);
            (cur, chain) = (n, next);
        }
    }
}
