//! Block tables, forks, leases and epochs, and a randomized operation-sequence test over the whole API.

use pdserve_kvcache::sim::{Driver, Op};
use pdserve_kvcache::{
    BlockCopy, KvCache, KvConfig, KvError, OwnerKind, SeqId, Slot, TierConfig, TransferId,
};

fn cache(num_blocks: u32, block_size: u32) -> KvCache {
    KvCache::new(KvConfig { num_blocks, block_size }).unwrap()
}

#[test]
fn invalid_config_is_refused() {
    assert!(matches!(
        KvCache::new(KvConfig { num_blocks: 0, block_size: 16 }),
        Err(KvError::InvalidConfig { .. })
    ));
    assert!(matches!(
        KvCache::new(KvConfig { num_blocks: 8, block_size: 0 }),
        Err(KvError::InvalidConfig { .. })
    ));
}

#[test]
fn append_decode_tokens_allocates_a_block_when_the_last_fills() {
    let mut kv = cache(16, 4);
    let s = SeqId(1);
    kv.add_sequence(s, &[1, 2, 3]).unwrap();
    kv.reserve(s, 3).unwrap();
    kv.commit(s, 3).unwrap();
    assert_eq!(kv.block_table(s).unwrap().len(), 1);
    for (i, t) in [10u32, 11, 12].into_iter().enumerate() {
        kv.append_tokens(s, &[t]).unwrap();
        kv.reserve(s, 1).unwrap();
        kv.commit(s, 1).unwrap();
        assert_eq!(kv.block_table(s).unwrap().len(), if i == 0 { 1 } else { 2 }, "after {} tokens", 4 + i);
    }
    let table = kv.block_table(s).unwrap().to_vec();
    let slots = kv.slot_mapping(s, 3..6).unwrap();
    assert_eq!(
        slots,
        [
            Slot { block: table[0], offset: 3 },
            Slot { block: table[1], offset: 0 },
            Slot { block: table[1], offset: 1 }
        ]
    );
    assert_eq!(slots[1].index(4), table[1].0 as usize * 4);
    assert!(matches!(kv.slot_mapping(s, 0..9), Err(KvError::OutOfRange { .. })));
    assert!(matches!(kv.commit(s, 1), Err(KvError::OutOfRange { .. })), "no token to commit");
    kv.check_invariants().unwrap();
}

#[test]
fn out_of_blocks_carries_the_numbers_and_changes_nothing() {
    let mut kv = cache(4, 4);
    kv.add_sequence(SeqId(1), &[0; 20]).unwrap();
    assert_eq!(kv.reserve(SeqId(1), 20), Err(KvError::OutOfBlocks { needed_blocks: 5, free_blocks: 4 }));
    assert_eq!(kv.block_table(SeqId(1)).unwrap().len(), 0);
    assert_eq!(kv.blocks_free(), 4);
    assert!(matches!(kv.commit(SeqId(1), 1), Err(KvError::NotReserved { .. })));
}

#[test]
fn fork_shares_blocks_and_copies_the_partial_block_on_first_write() {
    let mut kv = cache(16, 4);
    let (p, c) = (SeqId(1), SeqId(2));
    kv.add_sequence(p, &[1, 2, 3, 4, 5, 6]).unwrap();
    kv.reserve(p, 6).unwrap();
    kv.commit(p, 6).unwrap();
    kv.fork(p, c).unwrap();
    assert_eq!(kv.block_table(p).unwrap(), kv.block_table(c).unwrap());
    assert_eq!(kv.stats().owned(OwnerKind::Sequence), 2, "shared, not copied");
    let partial = kv.block_table(p).unwrap()[1];
    // The child writes first: it gets a copy of the 2 tokens in the partial block.
    kv.append_tokens(c, &[70]).unwrap();
    kv.reserve(c, 1).unwrap();
    let copies = kv.take_copies();
    let child_block = kv.block_table(c).unwrap()[1];
    assert_eq!(copies, [BlockCopy { src: partial, dst: child_block, tokens: 2 }]);
    kv.commit(c, 1).unwrap();
    // Now the parent owns its partial block alone and writes in place.
    kv.append_tokens(p, &[80]).unwrap();
    kv.reserve(p, 1).unwrap();
    assert!(kv.take_copies().is_empty());
    assert_eq!(kv.block_table(p).unwrap()[1], partial);
    kv.commit(p, 1).unwrap();
    assert_eq!(kv.block_table(p).unwrap()[0], kv.block_table(c).unwrap()[0], "full block still shared");
    kv.check_invariants().unwrap();
    kv.free_sequence(p, false).unwrap();
    kv.free_sequence(c, false).unwrap();
    assert_eq!(kv.blocks_free(), 16);
}

#[test]
fn truncate_into_a_cached_block_copies_before_writing() {
    let mut kv = cache(16, 4);
    let s = SeqId(1);
    kv.add_sequence(s, &[1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
    kv.reserve(s, 8).unwrap();
    kv.commit(s, 8).unwrap();
    kv.cache_prefix(s).unwrap();
    kv.truncate(s, 6).unwrap();
    kv.append_tokens(s, &[60, 61]).unwrap();
    kv.reserve(s, 2).unwrap();
    assert_eq!(kv.take_copies().len(), 1, "the cached block must not be overwritten");
    kv.commit(s, 2).unwrap();
    assert_eq!(kv.lookup_prefix(&[1, 2, 3, 4, 5, 6, 7, 8, 9]), 8, "cache still holds the old tokens");
    kv.check_invariants().unwrap();
}

#[test]
fn leases_expire_and_late_writes_are_recognised() {
    let mut kv = cache(8, 4);
    let (s, t) = (SeqId(1), TransferId(9));
    kv.add_sequence(s, &[1; 10]).unwrap();
    kv.reserve(s, 10).unwrap();
    kv.commit(s, 10).unwrap();
    let lease = kv.lease_sequence(s, t, 100).unwrap();
    let (block, epoch) = (lease.blocks[0], lease.epochs[0]);
    assert_eq!((lease.blocks.len(), lease.tokens), (3, 10));
    assert_eq!(kv.stats().owned(OwnerKind::Transfer), 3);
    assert!(kv.check_write(t, block, epoch).is_ok());
    assert!(kv.expire_leases(99).is_empty());
    assert_eq!(kv.expire_leases(100), [t]);
    let stats = kv.stats();
    assert_eq!((stats.blocks_free, stats.leases_expired_total, stats.leased_blocks_expired_total), (8, 1, 3));
    // The transfer ended: its late write is refused, and stays refused once the block is reused.
    assert!(matches!(kv.check_write(t, block, epoch), Err(KvError::StaleWrite { .. })));
    kv.allocate_lease(TransferId(10), 8, 200).unwrap();
    assert_ne!(kv.block_epoch(block), Some(epoch), "reuse moved the epoch on");
    assert!(kv.check_write(t, block, epoch).is_err());
    let reused = kv.lease(TransferId(10)).unwrap();
    let i = reused.blocks.iter().position(|&b| b == block).unwrap();
    assert!(kv.check_write(TransferId(10), block, epoch).is_err(), "old epoch, new owner");
    assert!(kv.check_write(TransferId(10), block, reused.epochs[i]).is_ok());
    kv.check_invariants().unwrap();
}

#[test]
fn decode_side_adopts_a_filled_lease_as_a_sequence() {
    let mut kv = cache(8, 4);
    let t = TransferId(3);
    kv.allocate_lease(t, 3, 1_000).unwrap();
    assert!(matches!(
        kv.adopt_lease(t, SeqId(5), &[0; 13]),
        Err(KvError::LeaseTooSmall { needed_blocks: 4, .. })
    ));
    kv.adopt_lease(t, SeqId(5), &[0; 6]).unwrap();
    assert_eq!(kv.computed_tokens(SeqId(5)).unwrap(), 6);
    assert_eq!(kv.block_table(SeqId(5)).unwrap().len(), 2);
    assert_eq!(kv.blocks_free(), 6, "the unneeded third block went back");
    assert!(kv.lease(t).is_err());
    kv.check_invariants().unwrap();
}

#[test]
fn a_prefill_leases_cached_blocks_which_stay_cached_after_the_transfer() {
    let mut kv = cache(8, 4);
    let (s, t) = (SeqId(1), TransferId(1));
    let prompt: Vec<u32> = (1..=10).collect();
    kv.add_sequence(s, &prompt).unwrap();
    kv.reserve(s, 10).unwrap();
    kv.commit(s, 10).unwrap();
    // As soon as the prefill is done: into the cache, then under the lease by reference.
    assert_eq!(kv.cache_prefix(s).unwrap(), 2);
    kv.lease_sequence(s, t, 100).unwrap();
    assert_eq!(kv.stats().owned(OwnerKind::Transfer), 3);
    // A request with the same prefix hits while the transfer is still running.
    let mut longer = prompt.clone();
    longer.extend([11, 12]);
    assert_eq!(kv.add_sequence(SeqId(2), &longer).unwrap().cached_tokens, 8);
    kv.free_sequence(SeqId(2), false).unwrap();
    kv.release_lease(t).unwrap();
    let st = kv.stats();
    assert_eq!((st.owned(OwnerKind::Cache), st.owned(OwnerKind::Transfer), st.blocks_free), (2, 0, 6));
    assert_eq!(st.blocks_evictable, 1, "the leaf of the cached chain is evictable");
    assert_eq!(kv.evict(8), 2, "and then its parent: nothing leaked");
    assert_eq!(kv.blocks_free(), 8);
    kv.check_invariants().unwrap();
}

#[test]
fn a_destination_lease_reuses_the_cached_prefix_and_only_fresh_blocks_are_written() {
    let mut kv = cache(8, 4);
    // An earlier round of the conversation finished here and stayed cached.
    let round1: Vec<u32> = (1..=9).collect();
    kv.add_sequence(SeqId(1), &round1).unwrap();
    kv.reserve(SeqId(1), 9).unwrap();
    kv.commit(SeqId(1), 9).unwrap();
    kv.free_sequence(SeqId(1), true).unwrap();
    // The next round's prompt extends it: 14 tokens, 4 blocks, the first 2 cached.
    let round2: Vec<u32> = (1..=14).collect();
    let t = TransferId(2);
    let lease = kv.allocate_lease_reusing(t, &round2, 4, 100).unwrap();
    let (reused, blocks, epochs) = (lease.reused, lease.blocks.to_vec(), lease.epochs.to_vec());
    assert_eq!((reused, blocks.len()), (2, 4));
    assert!(kv.check_write(t, blocks[0], epochs[0]).is_err(), "a reused block is never written");
    assert!(kv.check_write(t, blocks[2], epochs[2]).is_ok());
    // Pinned: eviction cannot take the reused blocks while the transfer runs.
    assert_eq!(kv.evict(8), 0);
    kv.adopt_lease(t, SeqId(2), &round2).unwrap();
    assert_eq!(kv.block_table(SeqId(2)).unwrap(), &blocks[..]);
    assert_eq!(kv.stats().lease_reused_blocks_total, 2);
    kv.free_sequence(SeqId(2), true).unwrap();
    kv.check_invariants().unwrap();
    // A prompt whose every block is cached reuses them all; a failed allocation takes nothing.
    let lease = kv.allocate_lease_reusing(TransferId(3), &round2[..12], 3, 100).unwrap();
    assert_eq!(lease.reused, 3);
    kv.release_lease(TransferId(3)).unwrap();
    let before = kv.stats();
    assert!(before.blocks_evictable > 0, "the conversation is cached, unreferenced");
    assert!(matches!(
        kv.allocate_lease_reusing(TransferId(4), &round2, 40, 100),
        Err(KvError::OutOfBlocks { .. })
    ));
    let after = kv.stats();
    assert_eq!(after.blocks_owned, before.blocks_owned, "a hopeless allocation evicts nothing");
    assert_eq!(after.evicted_blocks_total, before.evicted_blocks_total);
    kv.check_invariants().unwrap();
}

#[test]
fn duplicate_and_unknown_ids_are_errors() {
    let mut kv = cache(8, 4);
    kv.add_sequence(SeqId(1), &[1]).unwrap();
    assert_eq!(kv.add_sequence(SeqId(1), &[1]), Err(KvError::DuplicateSequence { seq: SeqId(1) }));
    assert_eq!(kv.free_sequence(SeqId(2), false), Err(KvError::UnknownSequence { seq: SeqId(2) }));
    assert_eq!(kv.release_lease(TransferId(1)), Err(KvError::UnknownTransfer { transfer: TransferId(1) }));
    kv.allocate_lease(TransferId(1), 1, 5).unwrap();
    assert!(matches!(kv.allocate_lease(TransferId(1), 1, 5), Err(KvError::DuplicateTransfer { .. })));
}

/// Thousands of random operations; invariants checked after each; everything comes back at the end.
#[test]
fn randomized_operation_sequences_keep_every_invariant() {
    for seed in 1..=20u64 {
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let mut bytes = std::iter::from_fn(move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            Some((state >> 24) as u8)
        });
        let block_size = [1, 4, 16][seed as usize % 3];
        let mut d = Driver::new(KvConfig { num_blocks: 48, block_size }).unwrap();
        if seed % 2 == 0 {
            // Half the runs with an offload tier behind the pool (host, then disk).
            d = d.with_tier(TierConfig { host_blocks: 6, disk_blocks: 10 });
        }
        for _ in 0..2_000 {
            let op = Op::decode(&mut bytes).unwrap();
            d.apply(op);
        }
        d.drain();
    }
}
