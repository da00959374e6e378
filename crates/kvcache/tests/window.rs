//! Sliding windows: blocks no later position attends to are given back while the sequence runs.

use pdserve_kvcache::{BlockId, KvCache, KvConfig, KvError, SeqId, TransferId};

const BS: usize = 4;

fn cache(num_blocks: u32) -> KvCache {
    KvCache::new(KvConfig { num_blocks, block_size: BS as u32 }).unwrap()
}

/// Decodes `n` tokens of `s` one at a time, releasing outside a window of `window` after each.
fn decode(kv: &mut KvCache, s: SeqId, n: usize, window: usize) {
    for i in 0..n {
        kv.append_tokens(s, &[10_000 + i as u32]).unwrap();
        kv.reserve(s, 1).unwrap();
        kv.commit(s, 1).unwrap();
        kv.release_outside_window(s, window).unwrap();
        kv.check_invariants().unwrap();
    }
}

#[test]
fn a_long_generation_holds_only_its_window() {
    let mut kv = cache(16);
    let s = SeqId(1);
    kv.add_sequence(s, &[1, 2, 3, 4, 5, 6]).unwrap();
    kv.reserve(s, 6).unwrap();
    kv.commit(s, 6).unwrap();
    // 6 + 100 tokens would need 27 blocks of a 16-block pool without the window.
    decode(&mut kv, s, 100, 10);
    let table = kv.block_table(s).unwrap();
    assert_eq!(table.len(), 106usize.div_ceil(BS), "the table still spans every position");
    let held: Vec<usize> = (0..table.len()).filter(|&i| !table[i].is_released()).collect();
    // The next position (106) sees 97..=106: blocks 24, 25 and 26 (the one being filled).
    assert_eq!(held, [24, 25, 26], "{table:?}");
    assert_eq!(kv.stats().blocks_free, 16 - 3);
    // Positions the window left cannot be read; those it covers can.
    assert!(matches!(kv.slot_mapping(s, 90..98), Err(KvError::Released { block_index: 22, .. })));
    assert_eq!(kv.slot_mapping(s, 96..106).unwrap().len(), 10);
    // Ending it caches nothing (its first block is gone) and frees the rest.
    kv.free_sequence(s, true).unwrap();
    kv.check_invariants().unwrap();
    assert_eq!(kv.stats().blocks_free, 16);
    assert_eq!(kv.lookup_prefix(&[1, 2, 3, 4, 5, 6, 7]), 0);
}

#[test]
fn cached_blocks_stay_and_shared_ones_stay_with_their_other_holder() {
    let mut kv = cache(32);
    let prompt: Vec<u32> = (0..9).collect();
    // Another request left the first two blocks in the prefix cache.
    let a = SeqId(1);
    kv.add_sequence(a, &prompt).unwrap();
    kv.reserve(a, 9).unwrap();
    kv.commit(a, 9).unwrap();
    kv.free_sequence(a, true).unwrap();
    let b = SeqId(2);
    assert_eq!(kv.add_sequence(b, &prompt).unwrap().cached_blocks, 2);
    kv.reserve(b, 1).unwrap();
    kv.commit(b, 1).unwrap();
    let cached = kv.block_table(b).unwrap()[..2].to_vec();
    decode(&mut kv, b, 20, 4);
    let table = kv.block_table(b).unwrap().to_vec();
    assert_eq!(table[..2], cached[..], "blocks in the prefix cache are not released");
    assert!(table[2..5].iter().all(|b| b.is_released()), "{table:?}");
    // A fork shares the window's blocks: releasing in one leaves them to the other.
    let c = SeqId(3);
    kv.fork(b, c).unwrap();
    decode(&mut kv, b, 8, 4);
    // b gave back blocks 6 and 7; c still sees positions 24..29 in them.
    assert!(kv.block_table(b).unwrap()[6..8].iter().all(|b| b.is_released()));
    assert_eq!(kv.slot_mapping(c, 24..29).unwrap().len(), 5);
    kv.free_sequence(b, false).unwrap();
    kv.free_sequence(c, true).unwrap();
    kv.check_invariants().unwrap();
    // Only the prompt's two cached blocks remain (the fork could not cache past its released block).
    assert_eq!(kv.stats().blocks_free, 32 - 2);
}

#[test]
fn what_needs_released_kv_is_refused() {
    let mut kv = cache(16);
    let s = SeqId(1);
    kv.add_sequence(s, &(0..22).collect::<Vec<u32>>()).unwrap();
    kv.reserve(s, 22).unwrap();
    kv.commit(s, 22).unwrap();
    assert_eq!(kv.release_outside_window(s, 6).unwrap(), 4, "positions 0..16 are outside 17..=22");
    assert_eq!(kv.release_outside_window(s, 6).unwrap(), 0, "nothing twice");
    // A lease hands over the whole prompt; computing from an earlier point needs the window there.
    assert!(matches!(kv.lease_sequence(s, TransferId(1), 100), Err(KvError::Released { .. })));
    assert!(matches!(kv.truncate(s, 10), Err(KvError::Released { .. })));
    kv.truncate(s, 22).unwrap();
    // A window of 0 counts as 1: the block the next position goes into is never given back.
    kv.release_outside_window(s, 0).unwrap();
    assert!(!kv.block_table(s).unwrap()[22 / BS].is_released());
    kv.check_invariants().unwrap();
    assert!(BlockId::RELEASED.is_released() && !BlockId(0).is_released());
}
