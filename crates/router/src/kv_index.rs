//! What each worker's prefix cache holds, as its KV events say (vLLM's `BlockStored`,
//! `BlockRemoved`, `AllBlocksCleared`): precise prefix routing where workers publish events.
//!
//! Blocks are keyed by the router's own *content chain* (a hash of every token from the prompt's
//! start to the end of the block), computed from the tokens each `BlockStored` carries, so the index
//! does not depend on how a publisher hashes (pdserve's and vLLM's hashes differ); a worker's block
//! hash only finds the block a later event names. A prompt's chains are computed the same way from
//! its tokens, and a worker's match is its longest run of held chains from the start.
//!
//! The index knows a worker's cache wholly once it has seen the worker's whole history: from its
//! first batch (sequence 0, replayed) or from an `AllBlocksCleared`. Joined later (the publisher's
//! replay buffer no longer starts at 0), it knows part: what it saw stored and not removed is held,
//! so a match is a lower bound and counts, but no match says nothing (the router's own approximate
//! tree decides). A gap no replay fills or a worker past [`BLOCKS_PER_WORKER_MAX`] starts it over.
//!
//! Each worker's entry belongs to one listener (its `epoch`): a listener replaced while it was still
//! connecting cannot touch its successor's entry.

use std::collections::HashMap;

use pdserve_kv_events::{Batch, KvEvent};

/// Blocks indexed per worker at most (about 80 bytes each); past it the worker's entry starts over,
/// knowing part of its cache. 1M blocks of 16 tokens cover 16M tokens of cache, pool and tiers.
pub const BLOCKS_PER_WORKER_MAX: usize = 1 << 20;

const ROOT_CHAIN: u64 = 0x6a09_e667_f3bc_c908;

/// The content chain of a block: its parent's chain and its tokens. The router's own, not a
/// publisher's; a collision costs one misrouted request, never a wrong answer (workers verify tokens).
pub fn chain(parent: u64, tokens: &[u32]) -> u64 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut h = parent.rotate_left(17) ^ (tokens.len() as u64).wrapping_mul(K);
    for &t in tokens {
        h = (h ^ u64::from(t)).wrapping_mul(K).rotate_left(31);
    }
    h ^ (h >> 29)
}

/// The chains of every full `block_size`-token block of `tokens`.
pub fn prompt_chains(tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut prev = ROOT_CHAIN;
    tokens
        .chunks_exact(block_size.max(1))
        .map(|b| {
            prev = chain(prev, b);
            prev
        })
        .collect()
}

fn medium_bit(medium: &str) -> u8 {
    match medium {
        "CPU" => 2,
        "DISK" => 4,
        _ => 1,
    }
}

#[derive(Debug, Default)]
struct WorkerCache {
    /// The publisher's block hash -> (content chain, the mediums holding it as bits).
    blocks: HashMap<u64, (u64, u8)>,
    /// Content chain -> how many indexed blocks have it.
    held: HashMap<u64, u32>,
    block_size: u32,
    /// The listener that owns the entry.
    epoch: u64,
    /// The whole history has been seen (see the module docs).
    complete: bool,
    /// The sequence number the next batch should carry.
    next_seq: Option<u64>,
}

impl WorkerCache {
    fn clear(&mut self) {
        self.blocks.clear();
        self.held.clear();
    }

    fn unhold(&mut self, c: u64) {
        if let Some(n) = self.held.get_mut(&c) {
            *n -= 1;
            if *n == 0 {
                self.held.remove(&c);
            }
        }
    }

    fn store(&mut self, hashes: &[u64], parent: Option<u64>, tokens: &[u32], block_size: u32, medium: &str) {
        let bs = block_size as usize;
        if bs == 0 || tokens.len() != hashes.len() * bs {
            return; // not whole blocks: nothing a prompt's chains could match
        }
        let mut prev = match parent {
            None => ROOT_CHAIN,
            Some(p) => match self.blocks.get(&p) {
                Some(&(c, _)) => c,
                None => return, // a parent never seen: these blocks cannot be placed
            },
        };
        self.block_size = block_size;
        let bit = medium_bit(medium);
        for (&h, t) in hashes.iter().zip(tokens.chunks_exact(bs)) {
            let c = chain(prev, t);
            match self.blocks.get_mut(&h) {
                Some(e) if e.0 == c => e.1 |= bit,
                Some(e) => {
                    let old = e.0;
                    *e = (c, bit);
                    self.unhold(old);
                    *self.held.entry(c).or_default() += 1;
                }
                None => {
                    self.blocks.insert(h, (c, bit));
                    *self.held.entry(c).or_default() += 1;
                }
            }
            prev = c;
        }
    }

    fn remove(&mut self, hashes: &[u64], medium: &str) {
        let bit = medium_bit(medium);
        for h in hashes {
            let Some(e) = self.blocks.get_mut(h) else { continue };
            e.1 &= !bit;
            if e.1 == 0 {
                let c = e.0;
                self.blocks.remove(h);
                self.unhold(c);
            }
        }
    }
}

/// How a batch went into the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Applied (or already applied: a replayed batch seen live).
    Ok,
    /// Batches are missing before it: nothing applied; replay from [`KvIndex::next_seq`] or
    /// [`KvIndex::reset`].
    Gap,
}

/// Every publishing worker's cache, by the router's worker id.
#[derive(Debug, Default)]
pub struct KvIndex {
    workers: HashMap<u32, WorkerCache>,
}

impl KvIndex {
    /// Starts `worker` over for the listener `epoch`, knowing nothing until batches come (a new
    /// subscription, a gap not replayed).
    pub fn reset(&mut self, worker: u32, epoch: u64) {
        self.workers.insert(worker, WorkerCache { epoch, ..WorkerCache::default() });
    }

    /// `worker` publishes nothing (any more), or left: unless another listener owns it now.
    pub fn forget(&mut self, worker: u32, epoch: u64) {
        if self.workers.get(&worker).is_some_and(|w| w.epoch == epoch) {
            self.workers.remove(&worker);
        }
    }

    /// The sequence number `worker`'s next batch should carry, once one was applied.
    pub fn next_seq(&self, worker: u32) -> Option<u64> {
        self.workers.get(&worker).and_then(|w| w.next_seq)
    }

    /// Applies one of `worker`'s batches, in sequence order, for the listener `epoch` (another's
    /// batches are ignored).
    pub fn apply(&mut self, worker: u32, epoch: u64, batch: &Batch) -> Applied {
        let Some(w) = self.workers.get_mut(&worker).filter(|w| w.epoch == epoch) else { return Applied::Ok };
        match w.next_seq {
            Some(n) if batch.seq < n => return Applied::Ok,
            Some(n) if batch.seq > n => return Applied::Gap,
            Some(_) => {}
            // The first batch seen: its history is whole only if it is the publisher's first.
            None => w.complete = batch.seq == 0,
        }
        w.next_seq = batch.seq.checked_add(1);
        for e in &batch.events {
            match e {
                KvEvent::AllBlocksCleared => {
                    w.clear();
                    w.complete = true;
                }
                KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, medium } => {
                    w.store(block_hashes, *parent_block_hash, token_ids, *block_size, medium)
                }
                KvEvent::BlockRemoved { block_hashes, medium } => w.remove(block_hashes, medium),
            }
            if w.blocks.len() > BLOCKS_PER_WORKER_MAX {
                w.clear();
                w.blocks.shrink_to_fit();
                w.held.shrink_to_fit();
                w.complete = false;
            }
        }
        Applied::Ok
    }

    /// The block size `worker`'s events use, once it published a block.
    pub fn block_size(&self, worker: u32) -> Option<u32> {
        self.workers.get(&worker).filter(|w| w.block_size > 0).map(|w| w.block_size)
    }

    /// The block size of the workers followed (the first found; workers of one model share it).
    pub fn any_block_size(&self) -> Option<u32> {
        self.workers.keys().find_map(|&w| self.block_size(w))
    }

    /// How many of `chains` (a prompt's, from its start) `worker` holds, in any medium: exact when
    /// its whole history was seen, a lower bound otherwise; `None` when the index cannot say (not
    /// followed, or part known and none of the prompt in it).
    pub fn matched(&self, worker: u32, chains: &[u64]) -> Option<usize> {
        let w = self.workers.get(&worker)?;
        let n = chains.iter().take_while(|c| w.held.contains_key(c)).count();
        (w.complete || n > 0).then_some(n)
    }

    /// What the index knows of `worker`'s cache: `whole`, `part`, or `None` (not followed).
    pub fn history(&self, worker: u32) -> Option<&'static str> {
        self.workers.get(&worker).map(|w| if w.complete { "whole" } else { "part" })
    }

    /// Blocks indexed for `worker`.
    pub fn blocks(&self, worker: u32) -> usize {
        self.workers.get(&worker).map_or(0, |w| w.blocks.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(seq: u64, events: Vec<KvEvent>) -> Batch {
        Batch { seq, ts: 0.0, events, data_parallel_rank: Some(0) }
    }

    fn stored(hashes: Vec<u64>, parent: Option<u64>, tokens: std::ops::Range<u32>) -> KvEvent {
        KvEvent::stored(hashes, parent, tokens.collect(), 4)
    }

    #[test]
    fn a_prompt_matches_the_blocks_a_worker_holds_from_its_start() {
        let mut ix = KvIndex::default();
        ix.reset(1, 0);
        let prompt: Vec<u32> = (0..14).collect();
        let chains = prompt_chains(&prompt, 4);
        assert_eq!(chains.len(), 3, "full blocks only");
        assert_eq!(ix.matched(1, &chains), None, "nothing seen yet");
        assert_eq!(ix.matched(3, &chains), None, "not followed");
        // Stores in two events, the second chained on the first by the publisher's hash.
        assert_eq!(
            ix.apply(1, 0, &batch(0, vec![KvEvent::AllBlocksCleared, stored(vec![70, 71], None, 0..8)])),
            Applied::Ok
        );
        assert_eq!(ix.matched(1, &chains), Some(2));
        ix.apply(1, 0, &batch(1, vec![stored(vec![72], Some(71), 8..12)]));
        assert_eq!(ix.matched(1, &chains), Some(3));
        assert_eq!(ix.block_size(1), Some(4));
        // Another prompt sharing the first block only.
        let other = prompt_chains(&[0, 1, 2, 3, 9, 9, 9, 9], 4);
        assert_eq!(ix.matched(1, &other), Some(1));
        // The middle block leaves the pool for the host tier, then the tier too: the run stops there.
        ix.apply(
            1,
            0,
            &batch(
                2,
                vec![
                    KvEvent::BlockStored {
                        block_hashes: vec![71],
                        parent_block_hash: Some(70),
                        token_ids: (4..8).collect(),
                        block_size: 4,
                        medium: "CPU",
                    },
                    KvEvent::removed(vec![71]),
                ],
            ),
        );
        assert_eq!(ix.matched(1, &chains), Some(3), "held on the host tier still counts");
        ix.apply(1, 0, &batch(3, vec![KvEvent::BlockRemoved { block_hashes: vec![71], medium: "CPU" }]));
        assert_eq!(ix.matched(1, &chains), Some(1));
        assert_eq!(ix.blocks(1), 2);
        // A store whose parent was never seen cannot be placed.
        ix.apply(1, 0, &batch(4, vec![stored(vec![99], Some(12345), 20..24)]));
        assert_eq!(ix.blocks(1), 2);
        // Cleared: nothing held, and still vouched for.
        ix.apply(1, 0, &batch(5, vec![KvEvent::AllBlocksCleared]));
        assert_eq!(ix.matched(1, &chains), Some(0));
    }

    #[test]
    fn part_of_a_history_is_a_lower_bound_and_listeners_keep_to_their_own_entry() {
        let mut ix = KvIndex::default();
        let chains = prompt_chains(&(0..8).collect::<Vec<_>>(), 4);
        let other = prompt_chains(&(100..108).collect::<Vec<_>>(), 4);
        // Joined late (the first batch seen is 5): what it saw stored counts, no match says nothing.
        ix.reset(2, 0);
        ix.apply(2, 0, &batch(5, vec![stored(vec![1, 2], None, 0..8)]));
        assert_eq!((ix.matched(2, &chains), ix.matched(2, &other)), (Some(2), None));
        assert_eq!(ix.history(2), Some("part"));
        // Once it clears everything, it is known whole: no match is a zero.
        ix.apply(2, 0, &batch(6, vec![KvEvent::AllBlocksCleared, stored(vec![1, 2], None, 0..8)]));
        assert_eq!((ix.matched(2, &chains), ix.matched(2, &other)), (Some(2), Some(0)));
        assert_eq!(ix.history(2), Some("whole"));
        // A replayed batch already seen changes nothing; one past a gap is refused.
        assert_eq!(ix.apply(2, 0, &batch(6, vec![KvEvent::AllBlocksCleared])), Applied::Ok);
        assert_eq!(ix.matched(2, &chains), Some(2));
        assert_eq!(ix.apply(2, 0, &batch(9, vec![KvEvent::AllBlocksCleared])), Applied::Gap);
        assert_eq!((ix.matched(2, &chains), ix.next_seq(2)), (Some(2), Some(7)));
        // A listener replaced (epoch 1 now) cannot touch its successor's entry.
        ix.reset(2, 1);
        assert_eq!(ix.matched(2, &chains), None);
        ix.apply(2, 0, &batch(0, vec![KvEvent::AllBlocksCleared]));
        ix.forget(2, 0);
        assert_eq!((ix.next_seq(2), ix.history(2)), (None, Some("part")));
        ix.apply(2, 1, &batch(0, vec![KvEvent::AllBlocksCleared]));
        assert_eq!((ix.next_seq(2), ix.history(2)), (Some(1), Some("whole")));
        ix.forget(2, 1);
        assert_eq!(ix.history(2), None);
        // A hostile last sequence number does not wrap.
        ix.reset(2, 2);
        ix.apply(2, 2, &batch(u64::MAX, vec![]));
        assert_eq!(ix.next_seq(2), None);
    }
}
