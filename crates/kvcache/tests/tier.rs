//! The offload tier: evicted blocks kept in host memory and on disk, and given back on a match, with
//! the copies that move their KV checked against a model of the memory itself.

use pdserve_kvcache::*;

fn kv(blocks: u32, tier: TierConfig) -> KvCache {
    let mut kv = KvCache::new(KvConfig { num_blocks: blocks, block_size: 4 }).unwrap();
    kv.enable_tier(tier);
    kv.record_events(1 << 16);
    kv
}

/// Computes `prompt` as sequence `seq` and ends it, its full blocks cached.
fn run(kv: &mut KvCache, seq: u64, prompt: &[u32]) -> PrefixHit {
    let hit = kv.add_sequence(SeqId(seq), prompt).unwrap();
    let n = prompt.len() - hit.cached_tokens;
    kv.reserve(SeqId(seq), n).unwrap();
    kv.commit(SeqId(seq), n).unwrap();
    kv.free_sequence(SeqId(seq), true).unwrap();
    kv.check_invariants().unwrap();
    hit
}

#[test]
fn evicted_blocks_come_back_from_the_tier_instead_of_being_computed() {
    let mut kv = kv(4, TierConfig { host_blocks: 8, disk_blocks: 0 });
    let a: Vec<u32> = (0..9).collect();
    assert_eq!(run(&mut kv, 1, &a).cached_tokens, 0);
    assert!(kv.take_tier_copies().is_empty());
    // Another prompt needs the whole pool: a's two cached blocks are evicted, into the tier.
    let b: Vec<u32> = (100..116).collect();
    run(&mut kv, 2, &b);
    let out = kv.take_tier_copies();
    assert_eq!(out.len(), 2, "{out:?}");
    assert!(out.iter().all(|c| matches!(c, TierCopy::Out { .. })));
    assert_eq!(kv.tier_stats().host_blocks_used, 2);
    // a again: both blocks are copied back, not computed.
    assert_eq!(kv.lookup_prefix(&a), 8);
    let hit = kv.add_sequence(SeqId(3), &a).unwrap();
    assert_eq!(hit.cached_tokens, 8);
    let back = kv.take_tier_copies();
    let ins: Vec<_> = back.iter().filter(|c| matches!(c, TierCopy::In { .. })).collect();
    assert_eq!(ins.len(), 2, "{back:?}");
    let table = kv.block_table(SeqId(3)).unwrap().to_vec();
    for (c, b) in ins.iter().zip(&table) {
        assert!(matches!(c, TierCopy::In { block, .. } if block == b), "{c:?} into {b}");
    }
    assert_eq!(kv.tier_stats().restored_blocks_total, 2);
    kv.check_invariants().unwrap();
    // The events name the medium of each move.
    let events = kv.take_events();
    let stored = |m: Medium| {
        events.iter().filter(|e| matches!(e, CacheEvent::Stored { medium, .. } if *medium == m)).count()
    };
    // (a's blocks back into the pool pushed two of b's out to the host.)
    assert_eq!((stored(Medium::Host), stored(Medium::Pool)), (4, 8), "{events:?}");
}

#[test]
fn host_memory_full_moves_blocks_down_to_disk_then_drops_the_oldest() {
    let mut kv = kv(2, TierConfig { host_blocks: 1, disk_blocks: 1 });
    // Three one-block prompts through a two-block pool: each evicts the one before it.
    for (i, base) in [0u32, 100, 200, 300].iter().enumerate() {
        let p: Vec<u32> = (*base..base + 5).collect();
        run(&mut kv, i as u64, &p);
    }
    let copies = kv.take_tier_copies();
    let downs = copies.iter().filter(|c| matches!(c, TierCopy::Down { .. })).count();
    assert!(downs >= 1, "{copies:?}");
    let st = kv.tier_stats();
    assert_eq!((st.host_blocks_used, st.disk_blocks_used), (1, 1));
    assert!(st.dropped_blocks_total >= 1, "{st:?}");
    let events = kv.take_events();
    assert!(
        events.iter().any(|e| matches!(e, CacheEvent::Stored { medium: Medium::Disk, .. })),
        "{events:?}"
    );
    assert!(
        events.iter().any(|e| matches!(e, CacheEvent::Removed { medium: Medium::Disk, .. })),
        "{events:?}"
    );
    // The oldest prompt is gone from every tier; the newest evicted one is still found.
    assert_eq!(kv.lookup_prefix(&(0..5).collect::<Vec<_>>()), 0);
    kv.check_invariants().unwrap();
}

/// What each pool block and tier slot holds: the hash of the token prefix whose KV is there.
struct Memory {
    pool: Vec<Option<u64>>,
    slots: Vec<Option<u64>>,
}

impl Memory {
    /// Performs the cache's copies, tier first, as an engine does before a step.
    fn apply(&mut self, kv: &mut KvCache) {
        for c in kv.take_tier_copies() {
            match c {
                TierCopy::Out { block, slot } => self.slots[slot.0 as usize] = self.pool[block.0 as usize],
                TierCopy::Down { from, to } => self.slots[to.0 as usize] = self.slots[from.0 as usize],
                TierCopy::In { slot, block } => self.pool[block.0 as usize] = self.slots[slot.0 as usize],
            }
        }
        for c in kv.take_copies() {
            self.pool[c.dst.0 as usize] = self.pool[c.src.0 as usize];
        }
    }
}

fn prefix_hash(tokens: &[u32]) -> u64 {
    tokens.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3))
}

/// Growing conversations through a pool far smaller than their working set, some running at once: every
/// block a prompt finds cached (in the pool or back from the tier) holds exactly that prefix's KV.
#[test]
fn every_block_found_again_holds_its_prefixs_kv() {
    let tier = TierConfig { host_blocks: 24, disk_blocks: 40 };
    let mut kv = kv(48, tier);
    let mut mem = Memory { pool: vec![None; 48], slots: vec![None; 64] };
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut convs: Vec<Vec<u32>> = (0..12).map(|c| (0..10).map(|i| c * 1000 + i).collect()).collect();
    let mut live: Vec<(u64, usize)> = Vec::new();
    let (mut restored_hits, mut seq) = (0, 0u64);
    for _ in 0..3000 {
        if !live.is_empty() && (live.len() >= 3 || next() % 2 == 0) {
            let (s, _) = live.remove((next() % live.len() as u64) as usize);
            kv.free_sequence(SeqId(s), true).unwrap();
            kv.check_invariants().unwrap();
            continue;
        }
        let c = (next() % convs.len() as u64) as usize;
        // The next round: the answer and a new message.
        let grow = 1 + next() % 9;
        let base = convs[c].len() as u32;
        convs[c].extend((0..grow as u32).map(|i| (c as u32) * 1000 + base + i));
        if convs[c].len() > 120 {
            convs[c].truncate(10);
        }
        let prompt = convs[c].clone();
        seq += 1;
        let restored_before = kv.tier_stats().restored_blocks_total;
        let hit = match kv.add_sequence(SeqId(seq), &prompt) {
            Ok(h) => h,
            Err(e) => panic!("{e}"),
        };
        let n = prompt.len() - hit.cached_tokens;
        if kv.reserve(SeqId(seq), n).is_err() {
            kv.free_sequence(SeqId(seq), false).unwrap();
            mem.apply(&mut kv);
            continue;
        }
        mem.apply(&mut kv);
        restored_hits += usize::from(kv.tier_stats().restored_blocks_total > restored_before);
        let table = kv.block_table(SeqId(seq)).unwrap().to_vec();
        for (i, b) in table.iter().enumerate().take(hit.cached_blocks) {
            let want = prefix_hash(&prompt[..(i + 1) * 4]);
            assert_eq!(mem.pool[b.0 as usize], Some(want), "block {i} of a hit holds another prefix's KV");
        }
        // The step writes the rest.
        for (i, b) in table.iter().enumerate().skip(hit.cached_blocks) {
            let end = ((i + 1) * 4).min(prompt.len());
            mem.pool[b.0 as usize] = Some(prefix_hash(&prompt[..end]));
        }
        kv.commit(SeqId(seq), n).unwrap();
        kv.check_invariants().unwrap();
        live.push((seq, c));
    }
    let st = kv.tier_stats();
    assert!(restored_hits > 100, "the tier served {restored_hits} prompts: {st:?}");
    assert!(st.demoted_blocks_total > 0 && st.dropped_blocks_total > 0, "{st:?}");
}

/// After a failed copy the engine gives the tier up: nothing it or the pool's unreferenced cache held
/// is found again (it may be KV that never arrived), what sequences hold stays, and eviction stops
/// copying out.
#[test]
fn dropping_the_tier_forgets_everything_it_could_have_corrupted() {
    let mut kv = kv(4, TierConfig { host_blocks: 8, disk_blocks: 0 });
    let a: Vec<u32> = (0..9).collect();
    run(&mut kv, 1, &a);
    run(&mut kv, 2, &(100..116).collect::<Vec<_>>());
    kv.add_sequence(SeqId(3), &(200..205).collect::<Vec<_>>()).unwrap();
    kv.reserve(SeqId(3), 5).unwrap();
    assert!(kv.lookup_prefix(&a) > 0);
    kv.drop_tier();
    assert!(kv.take_tier_copies().is_empty());
    assert_eq!(kv.tier_stats(), TierStats::default());
    assert_eq!((kv.lookup_prefix(&a), kv.stats().owned(OwnerKind::Cache)), (0, 0));
    assert_eq!(kv.block_table(SeqId(3)).unwrap().len(), 2, "a running sequence keeps its blocks");
    run(&mut kv, 4, &(300..308).collect::<Vec<_>>());
    run(&mut kv, 5, &(400..408).collect::<Vec<_>>());
    assert!(kv.stats().evicted_blocks_total > 0);
    assert!(kv.take_tier_copies().is_empty(), "no tier: evictions copy nothing out");
    kv.check_invariants().unwrap();
}
