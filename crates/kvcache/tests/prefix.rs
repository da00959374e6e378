//! Table tests for prefix matching and eviction.

use pdserve_kvcache::{KvCache, KvConfig, OwnerKind, SeqId};

const BS: usize = 4;

fn cache(num_blocks: u32) -> KvCache {
    KvCache::new(KvConfig { num_blocks, block_size: BS as u32 }).unwrap()
}

/// Runs `tokens` through a full prefill and frees the sequence into the cache.
fn prefill_and_cache(kv: &mut KvCache, seq: u64, tokens: &[u32]) {
    kv.add_sequence(SeqId(seq), tokens).unwrap();
    let todo = tokens.len() - kv.computed_tokens(SeqId(seq)).unwrap();
    kv.reserve(SeqId(seq), todo).unwrap();
    kv.commit(SeqId(seq), todo).unwrap();
    kv.free_sequence(SeqId(seq), true).unwrap();
    kv.check_invariants().unwrap();
}

fn seq(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

#[test]
fn longest_prefix_match_table() {
    let mut kv = cache(64);
    prefill_and_cache(&mut kv, 1, &seq(0..12)); // blocks [0..4) [4..8) [8..12)
    let mut branch = seq(0..4);
    branch.extend(100..108); // shares only the first block
    prefill_and_cache(&mut kv, 2, &branch);

    let mut divergent_mid_block = seq(0..6);
    divergent_mid_block.extend([999, 999, 1, 2]);
    let cases: Vec<(&str, Vec<u32>, usize)> = vec![
        ("empty prompt", vec![], 0),
        ("one token", vec![0], 0),
        ("shorter than a block", seq(0..3), 0),
        ("exactly one block: one token must stay to compute", seq(0..4), 0),
        ("one block and a bit", seq(0..5), 4),
        ("exact full match leaves the last block to compute", seq(0..12), 8),
        ("longer than cached", seq(0..20), 12),
        ("divergence inside the second block", divergent_mid_block, 4),
        ("other branch", branch.iter().copied().chain([7]).collect(), 12),
        ("first token differs", seq(1..13), 0),
    ];
    for (what, prompt, want) in cases {
        assert_eq!(kv.lookup_prefix(&prompt), want, "{what}");
    }
}

#[test]
fn admission_references_matched_blocks_so_they_cannot_be_evicted() {
    let mut kv = cache(8);
    prefill_and_cache(&mut kv, 1, &seq(0..16)); // 4 cached blocks
    assert_eq!(kv.stats().owned(OwnerKind::Cache), 4);
    let hit = kv.add_sequence(SeqId(2), &seq(0..17)).unwrap();
    assert_eq!((hit.cached_tokens, hit.cached_blocks), (16, 4));
    assert_eq!(kv.stats().owned(OwnerKind::Sequence), 4);
    // 4 free blocks remain; asking for 5 more fails even though the cache "has" 4 blocks: they are in use.
    let err = kv.reserve(SeqId(2), 1 + 4 * BS).unwrap_err();
    assert_eq!(err, pdserve_kvcache::KvError::OutOfBlocks { needed_blocks: 5, free_blocks: 4 });
    assert_eq!(kv.block_table(SeqId(2)).unwrap().len(), 4, "nothing allocated on failure");
    kv.check_invariants().unwrap();
}

#[test]
fn eviction_takes_least_recently_used_leaves_first_and_keeps_shared_prefixes() {
    let mut kv = cache(10);
    let a = seq(0..8); // shared prefix: 2 blocks
    let mut b = a.clone();
    b.extend(100..104);
    let mut c = a.clone();
    c.extend(200..204);
    prefill_and_cache(&mut kv, 1, &b); // [a0][a1][b]
    prefill_and_cache(&mut kv, 2, &c); // reuses a0 a1, adds [c]
    assert_eq!(kv.stats().owned(OwnerKind::Cache), 4);
    // Touch b's branch so c's leaf is the least recently used.
    kv.add_sequence(SeqId(3), &b.iter().copied().chain([1]).collect::<Vec<_>>()).unwrap();
    kv.free_sequence(SeqId(3), false).unwrap();
    assert_eq!(kv.evict(1), 1);
    assert_eq!(kv.lookup_prefix(&c.iter().copied().chain([1]).collect::<Vec<_>>()), 8, "c's leaf went first");
    assert_eq!(kv.lookup_prefix(&b.iter().copied().chain([1]).collect::<Vec<_>>()), 12, "b's branch stayed");
    // Shared prefix blocks go only after every leaf below them.
    assert_eq!(kv.evict(1), 1);
    assert_eq!(kv.lookup_prefix(&b.iter().copied().chain([1]).collect::<Vec<_>>()), 8);
    assert_eq!(kv.evict(10), 2);
    assert_eq!(kv.stats().blocks_free, 10);
    assert_eq!(kv.stats().evicted_blocks_total, 4);
    kv.check_invariants().unwrap();
}

#[test]
fn allocation_under_pressure_evicts_cache_but_never_referenced_blocks() {
    let mut kv = cache(6);
    prefill_and_cache(&mut kv, 1, &seq(0..16)); // 4 blocks cached
    kv.add_sequence(SeqId(2), &seq(0..9)).unwrap(); // references 2 of them
    kv.reserve(SeqId(2), 1).unwrap();
    // 6 blocks: 3 with seq 2, 2 cached and unreferenced, 1 free. Needing 3 evicts the two leaves.
    kv.add_sequence(SeqId(3), &seq(500..512)).unwrap();
    kv.reserve(SeqId(3), 12).unwrap();
    assert_eq!(kv.stats().evicted_blocks_total, 2);
    assert_eq!(kv.lookup_prefix(&seq(0..9)), 8, "referenced prefix survived");
    kv.check_invariants().unwrap();
}

#[test]
fn hit_and_miss_counters() {
    let mut kv = cache(32);
    prefill_and_cache(&mut kv, 1, &seq(0..12));
    kv.add_sequence(SeqId(2), &seq(0..14)).unwrap();
    let s = kv.stats();
    // First prompt: 3 blocks missed. Second: 3 hits, 1 miss (the partial tail).
    assert_eq!((s.prefix_hit_blocks_total, s.prefix_miss_blocks_total), (3, 4));
}

#[test]
fn every_unreferenced_cached_block_counts_as_available() {
    // One long chain fills the pool: only its last block is a leaf, but all of them can be evicted.
    let mut kv = cache(8);
    prefill_and_cache(&mut kv, 1, &seq(0..32));
    assert_eq!(kv.stats().owned(OwnerKind::Cache), 8);
    assert_eq!(kv.blocks_free(), 0);
    assert_eq!(kv.blocks_available(), 8, "a waiting request sized by this must be admitted");
    // And an allocation that size succeeds, evicting the chain leaf by leaf.
    kv.add_sequence(SeqId(2), &seq(100..132)).unwrap();
    kv.reserve(SeqId(2), 32).unwrap();
    kv.check_invariants().unwrap();
    // Blocks a sequence references (and their prefix) are not available.
    let mut kv = cache(8);
    prefill_and_cache(&mut kv, 1, &seq(0..32));
    kv.add_sequence(SeqId(3), &seq(0..9)).unwrap(); // references the first two blocks
    assert_eq!(kv.blocks_available(), 6);
}

/// With events recorded, every block the cache gains is a `Stored` (chained on its parent's hash, the
/// first on none, with its tokens) and every eviction a `Removed` of the same hash; a prompt that
/// shares a prefix stores only its new blocks, chained on the shared one; a full log drops and counts.
#[test]
fn events_follow_every_block_the_cache_gains_and_loses() {
    use pdserve_kvcache::CacheEvent;
    let mut kv = KvCache::new(KvConfig { num_blocks: 4, block_size: 4 }).unwrap();
    kv.record_events(100);
    let run = prefill_and_cache;
    run(&mut kv, 1, &[1, 2, 3, 4, 5, 6, 7, 8, 9]);
    let e = kv.take_events();
    let [CacheEvent::Stored { hash: a, parent: None, tokens: ta, .. }, CacheEvent::Stored { hash: b, parent: Some(pb), tokens: tb, .. }] =
        &e[..]
    else {
        panic!("{e:?}")
    };
    assert_eq!((ta.as_slice(), tb.as_slice(), *pb), (&[1, 2, 3, 4][..], &[5, 6, 7, 8][..], *a));
    assert!(kv.take_events().is_empty(), "taken");
    // Shares the first block: only the new one is stored, under the shared one.
    run(&mut kv, 2, &[1, 2, 3, 4, 9, 9, 9, 9, 0]);
    let e = kv.take_events();
    assert!(
        matches!(&e[..], [CacheEvent::Stored { parent: Some(p), tokens, .. }] if p == a && tokens == &[9, 9, 9, 9]),
        "{e:?}"
    );
    // A prompt needing every block evicts the cached ones, leaves first: each eviction is announced.
    run(&mut kv, 3, &(100..116).collect::<Vec<_>>());
    let removed: Vec<u64> = kv
        .take_events()
        .iter()
        .filter_map(|e| {
            if let CacheEvent::Removed { hash, medium: pdserve_kvcache::Medium::Pool } = e {
                Some(*hash)
            } else {
                None
            }
        })
        .collect();
    assert_eq!(removed.len(), 3);
    assert!(removed.contains(a) && removed.contains(b), "{removed:?}");
    assert_eq!(kv.events_dropped(), 0);
    // A log nobody takes stops at its bound, and counts the rest.
    let mut kv = KvCache::new(KvConfig { num_blocks: 8, block_size: 1 }).unwrap();
    kv.record_events(2);
    run(&mut kv, 1, &[1, 2, 3, 4, 5]);
    assert_eq!((kv.take_events().len(), kv.events_dropped()), (2, 3), "five blocks cached, two kept");
    kv.check_invariants().unwrap();
}
