//! The block pool, sequences, leases, and the ownership ledger tying them together.

use std::ops::Range;

use crate::prefix::{chain_hash, hash_tokens, IdMap, PrefixTree, ROOT, ROOT_CHAIN};
use crate::tier::{Medium, Tier, TierCopy, TierEvent};
use crate::{BlockId, KvError, NodeId, OwnerKind, SeqId, Slot, TransferId};

/// Size of the pool. Both numbers are fixed for the cache's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvConfig {
    pub num_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
}

/// Per-block bookkeeping. The owner kind is derived, never stored, so it cannot disagree with the refs.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct BlockMeta {
    pub(crate) seq_refs: u32,
    pub(crate) lease_refs: u32,
    pub(crate) node: Option<NodeId>,
    /// Bumped each time the block leaves the free list, so a late write aimed at an earlier use is seen.
    pub(crate) epoch: u32,
}

impl BlockMeta {
    pub(crate) fn owner(&self) -> Option<OwnerKind> {
        if self.seq_refs > 0 {
            Some(OwnerKind::Sequence)
        } else if self.lease_refs > 0 {
            Some(OwnerKind::Transfer)
        } else if self.node.is_some() {
            Some(OwnerKind::Cache)
        } else {
            None
        }
    }

    fn shared_or_cached(&self) -> bool {
        self.seq_refs + self.lease_refs > 1 || self.node.is_some()
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Sequence {
    pub(crate) blocks: Vec<BlockId>,
    pub(crate) tokens: Vec<u32>,
    /// Tokens whose K and V are written.
    pub(crate) computed: usize,
    /// Blocks before this index are released or pinned by the prefix cache (see
    /// [`KvCache::release_outside_window`]): where the next release looks from.
    pub(crate) release_from: usize,
}

#[derive(Debug, Clone)]
pub(crate) struct Lease {
    pub(crate) blocks: Vec<BlockId>,
    pub(crate) epochs: Vec<u32>,
    pub(crate) expires_at: u64,
    pub(crate) tokens: usize,
    /// Leading blocks taken from the prefix cache (their KV is here already; never written).
    pub(crate) reused: usize,
}

/// A read-only view of a lease.
#[derive(Debug, Clone, Copy)]
pub struct LeaseView<'a> {
    pub blocks: &'a [BlockId],
    /// The epoch of each block when the lease took it; writes must carry it.
    pub epochs: &'a [u32],
    /// In the caller's clock (the same unit as `now` in [`KvCache::expire_leases`]).
    pub expires_at: u64,
    /// Tokens whose KV the blocks hold (0 for a destination lease still being filled).
    pub tokens: usize,
    /// Destination leases: how many leading blocks came from this cache's prefix cache. Their KV is
    /// here already, so a transfer fills only `blocks[reused..]`.
    pub reused: usize,
}

/// A copy-on-write copy the backend must perform before the next step writes KV: the first `tokens`
/// slots of `src` to `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: BlockId,
    pub dst: BlockId,
    pub tokens: usize,
}

/// What [`KvCache::add_sequence`] found in the prefix cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixHit {
    /// Leading prompt tokens whose KV is reused; the caller computes from here.
    pub cached_tokens: usize,
    pub cached_blocks: usize,
}

/// Counters and gauges for `/metrics`. Block counts always add up: `blocks_free` plus the owned
/// counts equals `blocks_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvStats {
    pub blocks_total: usize,
    pub blocks_free: usize,
    /// Indexed by [`OwnerKind`] order: sequence, cache, transfer.
    pub blocks_owned: [usize; 3],
    /// Cached blocks nobody references, reclaimable by eviction now.
    pub blocks_evictable: usize,
    pub sequences: usize,
    pub leases: usize,
    pub prefix_hit_blocks_total: u64,
    pub prefix_miss_blocks_total: u64,
    pub evicted_blocks_total: u64,
    pub leases_expired_total: u64,
    pub leased_blocks_expired_total: u64,
    /// Destination-lease blocks taken from the prefix cache instead of being transferred.
    pub lease_reused_blocks_total: u64,
    pub cow_copies_total: u64,
}

impl KvStats {
    pub fn owned(&self, kind: OwnerKind) -> usize {
        self.blocks_owned[kind.index()]
    }
}

/// A change to the prefix cache's contents, in order ([`KvCache::record_events`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// A full block's KV became reusable in `medium`: its chain hash (of every token from the prompt's
    /// start to the block's end), its parent block's (`None` for a prompt's first block) and its
    /// tokens.
    Stored { hash: u64, parent: Option<u64>, tokens: Vec<u32>, medium: Medium },
    /// A cached block left `medium` (evicted from the pool, moved or dropped from the offload tier).
    Removed { hash: u64, medium: Medium },
}

/// The events recorded and not taken yet, at most `max` (past it they are dropped and counted).
#[derive(Debug)]
struct EventLog {
    events: Vec<CacheEvent>,
    max: usize,
    dropped: u64,
}

/// Paged KV bookkeeping for one worker: a fixed pool of blocks, per-sequence block tables, a prefix
/// cache, and transfer leases. Sans-IO: no clock (lease times come in as `now`), no threads.
#[derive(Debug)]
pub struct KvCache {
    pub(crate) config: KvConfig,
    pub(crate) blocks: Vec<BlockMeta>,
    pub(crate) free: Vec<BlockId>,
    pub(crate) owned: [usize; 3],
    pub(crate) seqs: IdMap<SeqId, Sequence>,
    pub(crate) leases: IdMap<TransferId, Lease>,
    pub(crate) tree: PrefixTree,
    copies: Vec<BlockCopy>,
    pub(crate) stats: KvStats,
    events: Option<EventLog>,
    /// The offload tier, when enabled ([`enable_tier`](Self::enable_tier)).
    pub(crate) tier: Option<Tier>,
    pub(crate) tier_copies: Vec<TierCopy>,
    pub(crate) tier_events: Vec<TierEvent>,
}

impl KvCache {
    /// Allocates all bookkeeping for `num_blocks` blocks now; nothing grows afterwards but the prefix
    /// tree's node arena, which is bounded by `num_blocks`.
    pub fn new(config: KvConfig) -> Result<KvCache, KvError> {
        if config.num_blocks == 0 || config.block_size == 0 || config.num_blocks == u32::MAX {
            return Err(KvError::InvalidConfig {
                num_blocks: config.num_blocks,
                block_size: config.block_size,
            });
        }
        let n = config.num_blocks as usize;
        Ok(KvCache {
            config,
            blocks: vec![BlockMeta::default(); n],
            // Reversed so that blocks come off the stack in ascending order (contiguous early on).
            free: (0..config.num_blocks).rev().map(BlockId).collect(),
            owned: [0; 3],
            seqs: IdMap::default(),
            leases: IdMap::default(),
            tree: PrefixTree::new(config.block_size as usize),
            copies: Vec::new(),
            stats: KvStats { blocks_total: n, ..KvStats::default() },
            events: None,
            tier: None,
            tier_copies: Vec::new(),
            tier_events: Vec::new(),
        })
    }

    /// From now on, records every block the prefix cache gains or loses ([`CacheEvent`]), keeping at
    /// most `max` until [`take_events`](Self::take_events) takes them.
    pub fn record_events(&mut self, max: usize) {
        self.events = Some(EventLog { events: Vec::new(), max, dropped: 0 });
    }

    /// The events recorded since the last call, in order.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.events.as_mut().map(|l| std::mem::take(&mut l.events)).unwrap_or_default()
    }

    /// Events dropped because nobody took them in time.
    pub fn events_dropped(&self) -> u64 {
        self.events.as_ref().map_or(0, |l| l.dropped)
    }

    pub(crate) fn record(&mut self, e: impl FnOnce() -> CacheEvent) {
        if let Some(l) = self.events.as_mut() {
            if l.events.len() < l.max {
                l.events.push(e());
            } else {
                l.dropped += 1;
            }
        }
    }

    pub fn config(&self) -> KvConfig {
        self.config
    }

    pub fn block_size(&self) -> usize {
        self.config.block_size as usize
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size())
    }

    /// Blocks on the free list.
    pub fn blocks_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks an allocation can get: free ones plus every cached block no sequence or lease references.
    /// (Only unreferenced leaves are evictable at once, but whoever references a block references its
    /// whole prefix, so each unreferenced block's descendants are unreferenced too: evicting leaf by
    /// leaf reaches all of them. Counting only the leaves once left a request waiting for room that
    /// nothing would ever make, with the pool full of cached interior blocks.)
    pub fn blocks_available(&self) -> usize {
        self.free.len() + self.owned[OwnerKind::Cache.index()]
    }

    pub fn stats(&self) -> KvStats {
        KvStats {
            blocks_free: self.free.len(),
            blocks_owned: self.owned,
            blocks_evictable: self.tree.lru.len(),
            sequences: self.seqs.len(),
            leases: self.leases.len(),
            ..self.stats
        }
    }

    // ---- the ownership ledger: every change of a block's refs goes through `retag` ----

    /// Applies `change` to block `b`'s bookkeeping and keeps the owner counts, the free list and the
    /// prefix tree's LRU in step with it.
    pub(crate) fn retag(&mut self, b: BlockId, change: impl FnOnce(&mut BlockMeta)) {
        let m = &mut self.blocks[b.0 as usize];
        let before = m.owner();
        change(m);
        let after = m.owner();
        let (unreferenced, node) = (m.seq_refs == 0 && m.lease_refs == 0, m.node);
        if before != after {
            if let Some(k) = before {
                self.owned[k.index()] -= 1;
            }
            if let Some(k) = after {
                self.owned[k.index()] += 1;
            }
            if after.is_none() {
                self.free.push(b);
            }
        }
        if let Some(n) = node {
            self.tree.set_unreferenced(n, unreferenced);
        }
    }

    /// Takes a block off the free list; the caller references it at once.
    fn pop_free(&mut self) -> BlockId {
        let b = self.free.pop().unwrap_or_else(|| unreachable!("callers ensure free blocks first"));
        let m = &mut self.blocks[b.0 as usize];
        assert!(m.owner().is_none(), "{b} on the free list is owned");
        m.epoch = m.epoch.wrapping_add(1);
        b
    }

    pub(crate) fn alloc_for_seq(&mut self) -> BlockId {
        let b = self.pop_free();
        self.retag(b, |m| m.seq_refs += 1);
        b
    }

    pub(crate) fn alloc_for_lease(&mut self) -> BlockId {
        let b = self.pop_free();
        self.retag(b, |m| m.lease_refs += 1);
        b
    }

    /// Makes `n` blocks free, evicting least recently used cached blocks if needed. All or nothing for
    /// the caller: on error nothing was allocated (some cache entries may have been evicted).
    pub(crate) fn ensure_free(&mut self, n: usize) -> Result<(), KvError> {
        // Every block eviction could ever reclaim is cache-owned: fewer than needed, and the cache is
        // left as it is instead of being emptied for nothing.
        if self.free.len() + self.owned[OwnerKind::Cache.index()] < n {
            return Err(KvError::OutOfBlocks { needed_blocks: n, free_blocks: self.free.len() });
        }
        while self.free.len() < n {
            if !self.evict_one() {
                return Err(KvError::OutOfBlocks { needed_blocks: n, free_blocks: self.free.len() });
            }
        }
        Ok(())
    }

    fn evict_one(&mut self) -> bool {
        let Some(victim) = self.tree.lru_victim() else { return false };
        let node = self.tree.node(victim);
        let (hash, parent) = (node.chain, self.tree.node(node.parent).chain);
        if let Some(t) = self.tier.as_mut() {
            // Its KV goes to the tier before the block is written again.
            let key = (hash, parent, self.tree.node_tokens(victim));
            t.put(key, node.block, &mut self.tier_copies, &mut self.tier_events);
        }
        let b = self.tree.remove(victim);
        self.record(|| CacheEvent::Removed { hash, medium: Medium::Pool });
        self.record_tier_events();
        self.retag(b, |m| m.node = None);
        self.stats.evicted_blocks_total += 1;
        true
    }

    /// Evicts up to `n` unreferenced cached blocks now; returns how many.
    pub fn evict(&mut self, n: usize) -> usize {
        (0..n).take_while(|_| self.evict_one()).count()
    }

    // ---- sequences ----

    /// Cached tokens of `tokens`' longest prefix, without taking anything. At least one token is always
    /// left to compute, since the next step needs its logits.
    pub fn lookup_prefix(&self, tokens: &[u32]) -> usize {
        let bs = self.block_size();
        let full = tokens.len().saturating_sub(1) / bs;
        let path = self.tree.longest_match(tokens, full);
        let Some(t) = self.tier.as_ref() else { return path.len() * bs };
        // Blocks the offload tier holds count too: they are copied back, not computed.
        let mut chain = path.last().map_or(ROOT_CHAIN, |&n| self.tree.node(n).chain);
        let mut n = path.len();
        for block in tokens.chunks_exact(bs).take(full).skip(n) {
            let next = chain_hash(chain, hash_tokens(block));
            if !t.holds(next, chain, block) {
                break;
            }
            (chain, n) = (next, n + 1);
        }
        n * bs
    }

    /// Registers `seq` with its prompt, reusing the longest cached prefix (those blocks are referenced
    /// now, so they cannot be evicted). KV for the rest is reserved with [`reserve`](Self::reserve).
    pub fn add_sequence(&mut self, seq: SeqId, prompt: &[u32]) -> Result<PrefixHit, KvError> {
        self.add_sequence_within(seq, prompt, usize::MAX)
    }

    /// [`add_sequence`](Self::add_sequence) reusing at most `max_blocks` cached blocks (KV groups: the
    /// hit every group and a restore point share).
    pub(crate) fn add_sequence_within(
        &mut self,
        seq: SeqId,
        prompt: &[u32],
        max_blocks: usize,
    ) -> Result<PrefixHit, KvError> {
        if self.seqs.contains_key(&seq) {
            return Err(KvError::DuplicateSequence { seq });
        }
        let bs = self.block_size();
        let full = (prompt.len().saturating_sub(1) / bs).min(max_blocks);
        let path = self.tree.longest_match(prompt, full);
        let mut blocks: Vec<BlockId> = path.iter().map(|&n| self.tree.node(n).block).collect();
        for &b in &blocks {
            self.retag(b, |m| m.seq_refs += 1);
        }
        if self.tier.is_some() {
            let last = path.last().copied().unwrap_or(ROOT);
            self.restore(prompt, full, last, &mut blocks);
        }
        self.stats.prefix_hit_blocks_total += blocks.len() as u64;
        self.stats.prefix_miss_blocks_total += (self.blocks_for(prompt.len()) - blocks.len()) as u64;
        let hit = PrefixHit { cached_tokens: blocks.len() * bs, cached_blocks: blocks.len() };
        let s = Sequence { blocks, tokens: prompt.to_vec(), computed: hit.cached_tokens, release_from: 0 };
        self.seqs.insert(seq, s);
        Ok(hit)
    }

    pub(crate) fn seq(&self, seq: SeqId) -> Result<&Sequence, KvError> {
        self.seqs.get(&seq).ok_or(KvError::UnknownSequence { seq })
    }

    fn seq_mut(&mut self, seq: SeqId) -> Result<&mut Sequence, KvError> {
        self.seqs.get_mut(&seq).ok_or(KvError::UnknownSequence { seq })
    }

    /// Appends known tokens (sampled ones) to `seq`; their KV is written by a later step.
    pub fn append_tokens(&mut self, seq: SeqId, tokens: &[u32]) -> Result<(), KvError> {
        self.seq_mut(seq)?.tokens.extend_from_slice(tokens);
        Ok(())
    }

    /// Makes room to write KV for the next `n` tokens of `seq`: allocates the blocks they need and, if
    /// the partial last block is shared, gives `seq` its own copy (see [`take_copies`](Self::take_copies)).
    /// All or nothing: on `OutOfBlocks` the sequence is unchanged.
    pub fn reserve(&mut self, seq: SeqId, n: usize) -> Result<(), KvError> {
        let (need, cow) = self.reserve_plan(seq, n)?;
        let partial = self.seq(seq)?.computed % self.block_size();
        if need == 0 && cow.is_none() {
            // The common decode case: the last block has room and is this sequence's alone.
            return Ok(());
        }
        self.ensure_free(need + usize::from(cow.is_some()))?;
        let mut fresh = Vec::with_capacity(need);
        for _ in 0..need {
            fresh.push(self.alloc_for_seq());
        }
        if let Some(src) = cow {
            let dst = self.alloc_for_seq();
            self.copies.push(BlockCopy { src, dst, tokens: partial });
            self.stats.cow_copies_total += 1;
            self.retag(src, |m| m.seq_refs -= 1);
            let bs = self.block_size();
            let s = self.seq_mut(seq)?;
            let at = s.computed / bs;
            s.blocks[at] = dst;
        }
        self.seq_mut(seq)?.blocks.extend(fresh);
        Ok(())
    }

    /// What [`reserve`](Self::reserve) of `n` tokens needs: fresh blocks, and the shared partial
    /// last block it would copy.
    fn reserve_plan(&self, seq: SeqId, n: usize) -> Result<(usize, Option<BlockId>), KvError> {
        let bs = self.block_size();
        let s = self.seq(seq)?;
        let need = (s.computed + n).div_ceil(bs).saturating_sub(s.blocks.len());
        let cow = (n > 0 && s.computed % bs != 0)
            .then(|| s.blocks[s.computed / bs])
            .filter(|b| self.blocks[b.0 as usize].shared_or_cached());
        Ok((need, cow))
    }

    /// Blocks [`reserve`](Self::reserve) of `n` tokens would take from the pool.
    pub(crate) fn reserve_need(&self, seq: SeqId, n: usize) -> Result<usize, KvError> {
        self.reserve_plan(seq, n).map(|(need, cow)| need + usize::from(cow.is_some()))
    }

    /// Copy-on-write copies made by `reserve` since the last call; the backend runs them before the
    /// step that writes into the destination blocks.
    pub fn take_copies(&mut self) -> Vec<BlockCopy> {
        std::mem::take(&mut self.copies)
    }

    /// Records that the next `n` tokens' KV has been written.
    pub fn commit(&mut self, seq: SeqId, n: usize) -> Result<(), KvError> {
        self.commit_check(seq, n)?;
        self.seq_mut(seq)?.computed += n;
        Ok(())
    }

    /// Why [`commit`](Self::commit) of `n` tokens would be refused, if it would.
    pub(crate) fn commit_check(&self, seq: SeqId, n: usize) -> Result<(), KvError> {
        let bs = self.config.block_size as usize;
        let s = self.seq(seq)?;
        let target = s.computed + n;
        if target > s.tokens.len() {
            return Err(KvError::OutOfRange { seq, requested: target, limit: s.tokens.len() });
        }
        let partial_shared = n > 0
            && s.computed % bs != 0
            && self.blocks[s.blocks[s.computed / bs].0 as usize].shared_or_cached();
        if target > s.blocks.len() * bs || partial_shared {
            return Err(KvError::NotReserved { seq });
        }
        Ok(())
    }

    /// The block table of `seq`: block `i` holds tokens `i*block_size .. (i+1)*block_size`.
    pub fn block_table(&self, seq: SeqId) -> Result<&[BlockId], KvError> {
        Ok(&self.seq(seq)?.blocks)
    }

    /// Tokens of `seq` with KV written.
    pub fn computed_tokens(&self, seq: SeqId) -> Result<usize, KvError> {
        Ok(self.seq(seq)?.computed)
    }

    /// All known tokens of `seq`.
    pub fn tokens(&self, seq: SeqId) -> Result<&[u32], KvError> {
        Ok(&self.seq(seq)?.tokens)
    }

    /// Where positions `range` of `seq` live. Every position must be covered by a block.
    pub fn slot_mapping(&self, seq: SeqId, range: Range<usize>) -> Result<Vec<Slot>, KvError> {
        let bs = self.block_size();
        let s = self.seq(seq)?;
        if range.end > s.blocks.len() * bs {
            return Err(KvError::OutOfRange { seq, requested: range.end, limit: s.blocks.len() * bs });
        }
        if let Some(p) = range.clone().find(|p| s.blocks[p / bs].is_released()) {
            return Err(KvError::Released { seq, block_index: p / bs });
        }
        Ok(range.map(|p| Slot { block: s.blocks[p / bs], offset: (p % bs) as u32 }).collect())
    }

    /// Gives back every block of `seq` that no position it will still compute attends to, with a
    /// sliding window of `window` positions (a query at position p sees p + 1 - window ..= p): the
    /// blocks wholly before `computed + 1 - window`. Each becomes [`BlockId::RELEASED`] in the block
    /// table and is freed unless another sequence, a lease or the prefix cache holds it. Blocks in the
    /// prefix cache are kept (the cache holds a prefix only while every block of it is there), so a
    /// windowed sequence's memory is its window plus what it shares with the cache. Returns how many
    /// blocks were released now.
    pub fn release_outside_window(&mut self, seq: SeqId, window: usize) -> Result<usize, KvError> {
        let bs = self.block_size();
        let s = self.seq(seq)?;
        let end = ((s.computed + 1).saturating_sub(window.max(1)) / bs).min(s.blocks.len());
        let from = s.release_from;
        let mut released = 0;
        for i in from..end {
            let b = self.seq(seq)?.blocks[i];
            if b.is_released() || self.blocks[b.0 as usize].node.is_some() {
                continue;
            }
            self.retag(b, |m| m.seq_refs -= 1);
            self.seq_mut(seq)?.blocks[i] = BlockId::RELEASED;
            released += 1;
        }
        let s = self.seq_mut(seq)?;
        s.release_from = s.release_from.max(end);
        Ok(released)
    }

    /// Inserts `seq`'s full, computed blocks into the prefix cache (at prefill completion or at the end).
    /// Returns how many blocks were newly cached.
    pub fn cache_prefix(&mut self, seq: SeqId) -> Result<usize, KvError> {
        let bs = self.block_size();
        let s = self.seq(seq)?;
        let full = s.computed / bs;
        let (tokens, blocks) = (s.tokens[..full * bs].to_vec(), s.blocks[..full].to_vec());
        let mut cur = ROOT;
        let mut inserted = 0;
        for (chunk, &b) in tokens.chunks_exact(bs).zip(&blocks) {
            // A released block ends the prefix this sequence can vouch for: a cached block must never
            // hang below one the sequence does not hold.
            if b.is_released() {
                break;
            }
            if let Some(n) = self.tree.child(cur, chunk) {
                // Cached already (possibly in another block holding the same KV): follow it.
                cur = n;
                continue;
            }
            if self.blocks[b.0 as usize].node.is_some() {
                break;
            }
            let Some(n) = self.tree.insert(cur, chunk, b) else { break };
            self.retag(b, |m| m.node = Some(n));
            let (hash, parent) = (self.tree.node(n).chain, (cur != ROOT).then(|| self.tree.node(cur).chain));
            self.record(|| CacheEvent::Stored { hash, parent, tokens: chunk.to_vec(), medium: Medium::Pool });
            inserted += 1;
            cur = n;
        }
        Ok(inserted)
    }

    /// Ends `seq`, first caching its full blocks if `cache` is set. Blocks nobody else holds are freed.
    pub fn free_sequence(&mut self, seq: SeqId, cache: bool) -> Result<(), KvError> {
        if cache {
            self.cache_prefix(seq)?;
        }
        let s = self.seqs.remove(&seq).ok_or(KvError::UnknownSequence { seq })?;
        for b in s.blocks.into_iter().filter(|b| !b.is_released()) {
            self.retag(b, |m| m.seq_refs -= 1);
        }
        Ok(())
    }

    /// Cuts `seq` back to its first `n` tokens, freeing blocks past them.
    pub fn truncate(&mut self, seq: SeqId, n: usize) -> Result<(), KvError> {
        self.truncate_check(seq, n)?;
        let keep = self.blocks_for(n);
        let s = self.seq_mut(seq)?;
        s.tokens.truncate(n);
        s.computed = s.computed.min(n);
        let dropped = s.blocks.split_off(keep.min(s.blocks.len()));
        s.release_from = s.release_from.min(keep);
        for b in dropped.into_iter().filter(|b| !b.is_released()) {
            self.retag(b, |m| m.seq_refs -= 1);
        }
        Ok(())
    }

    /// Why [`truncate`](Self::truncate) to `n` tokens would be refused, if it would.
    pub(crate) fn truncate_check(&self, seq: SeqId, n: usize) -> Result<(), KvError> {
        let s = self.seq(seq)?;
        if n > s.tokens.len() {
            return Err(KvError::OutOfRange { seq, requested: n, limit: s.tokens.len() });
        }
        // Computing from n again needs the window before n, which a release may have given back.
        if n < s.computed {
            if let Some(i) = s.blocks.iter().rposition(|b| b.is_released()) {
                return Err(KvError::Released { seq, block_index: i });
            }
        }
        Ok(())
    }

    /// Starts `child` as a copy of `parent` sharing every computed block (parallel sampling). The
    /// partial last block is copied lazily by whichever sequence writes into it first.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<(), KvError> {
        if self.seqs.contains_key(&child) {
            return Err(KvError::DuplicateSequence { seq: child });
        }
        let p = self.seq(parent)?;
        let keep = self.blocks_for(p.computed);
        let s = Sequence {
            blocks: p.blocks[..keep].to_vec(),
            tokens: p.tokens.clone(),
            computed: p.computed,
            release_from: p.release_from.min(keep),
        };
        for &b in s.blocks.iter().filter(|b| !b.is_released()) {
            self.retag(b, |m| m.seq_refs += 1);
        }
        self.seqs.insert(child, s);
        Ok(())
    }
}
