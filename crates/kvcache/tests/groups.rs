//! KV groups: one pool per kind of layer, per-request state slots, restore points, and a grouped
//! request's transfer; named cases, then thousands of random operations with every invariant and the
//! modelled contents checked after each.

use pdserve_kvcache::sim_groups::{config, GroupDriver, GroupOp, BLOCK_TOKENS};
use pdserve_kvcache::{
    GroupSpec, GroupsConfig, KvError, KvGroups, LayerKind, OwnerKind, SeqId, StateCopy, TransferId,
};

const BT: usize = BLOCK_TOKENS as usize;

fn groups(blocks: [u32; 3], state_bytes: u32, slots: u32) -> KvGroups {
    KvGroups::new(config(blocks, state_bytes, slots)).unwrap()
}

/// Runs `n` tokens of `seq` (appending placeholder tokens past its prompt).
fn run(kv: &mut KvGroups, seq: SeqId, n: usize) {
    let (computed, known) = (kv.computed_tokens(seq).unwrap(), kv.tokens(seq).unwrap().len());
    let extra: Vec<u32> = (0..(computed + n).saturating_sub(known) as u32).map(|t| 9_000 + t).collect();
    kv.append_tokens(seq, &extra).unwrap();
    kv.reserve(seq, n).unwrap();
    kv.commit(seq, n).unwrap();
}

/// DeepSeek V4-Flash's groups, to scale: bytes per token per group and the fixed state, as
/// `/v1/models` reports them.
#[test]
fn each_group_has_its_geometry_and_bytes_per_token() {
    let spec = |name: &str, kind, layers, row_bytes| GroupSpec {
        name: name.into(),
        kind,
        layers,
        row_bytes,
        num_blocks: 4,
    };
    let kv = KvGroups::new(GroupsConfig {
        block_tokens: 256,
        groups: vec![
            // Compressed rows: 448 FP8 values, 64 bf16 rope values and a scale (a 584-byte row).
            spec("c4", LayerKind::Compressed { ratio: 4 }, 21, 584),
            spec("c4-index", LayerKind::Compressed { ratio: 4 }, 21, 132),
            spec("c128", LayerKind::Compressed { ratio: 128 }, 20, 584),
        ],
        state_bytes: 43 * 128 * 584,
        state_slots: 8,
        state_rewind_tokens: 0,
    })
    .unwrap();
    let per: Vec<f64> = kv.config().groups.iter().map(GroupSpec::bytes_per_token).collect();
    assert_eq!(per, [21.0 * 584.0 / 4.0, 21.0 * 132.0 / 4.0, 20.0 * 584.0 / 128.0]);
    assert!((kv.bytes_per_token() - per.iter().sum::<f64>()).abs() < 1e-9);
    // A ratio that does not divide the block would put a row across two blocks.
    let bad = GroupsConfig {
        block_tokens: 12,
        groups: vec![spec("c8", LayerKind::Compressed { ratio: 8 }, 1, 1)],
        state_bytes: 0,
        state_slots: 1,
        state_rewind_tokens: 0,
    };
    assert!(matches!(KvGroups::new(bad), Err(KvError::InvalidConfig { .. })));
}

/// A compressed group's block holds `block_tokens / ratio` rows: row w of the c4 group is in block
/// w / 2, the c8 group's in block w.
#[test]
fn compressed_rows_map_to_their_blocks() {
    let mut kv = groups([16, 16, 16], 0, 4);
    let s = SeqId(1);
    kv.add_sequence(s, &(0..20).collect::<Vec<u32>>()).unwrap();
    run(&mut kv, s, 20);
    let c4 = kv.block_table(s, 1).unwrap().to_vec();
    let rows = kv.row_slots(s, 1, 0..5).unwrap();
    assert_eq!(
        rows.iter().map(|r| (r.block, r.offset)).collect::<Vec<_>>(),
        [(c4[0], 0), (c4[0], 1), (c4[1], 0), (c4[1], 1), (c4[2], 0)]
    );
    let c8 = kv.block_table(s, 2).unwrap().to_vec();
    assert_eq!(kv.row_slots(s, 2, 2..3).unwrap()[0].block, c8[2]);
    assert!(matches!(kv.row_slots(s, 2, 0..4), Err(KvError::OutOfRange { .. })));
    // The window group maps tokens as a plain cache does.
    assert_eq!(kv.row_slots(s, 0, 9..10).unwrap()[0].offset, 1);
}

/// A stateful model resumes a prefix only where its state was saved: the second request with the
/// same prompt gets the blocks every group cached and a copy of the restore point.
#[test]
fn a_prefix_hit_resumes_from_a_restore_point() {
    let mut kv = groups([16, 16, 16], 100, 6);
    let prompt: Vec<u32> = (0..30).collect();
    let a = SeqId(1);
    let hit = kv.add_sequence(a, &prompt).unwrap();
    assert_eq!((hit.cached_tokens, hit.restore), (0, None));
    run(&mut kv, a, 2 * BT);
    // Cached blocks but no restore point yet: nothing to resume from.
    kv.cache_prefix(a).unwrap();
    assert_eq!(kv.lookup_prefix(&prompt), 0);
    let save = kv.save_restore_point(a).unwrap().expect("a point at 16 tokens");
    assert_eq!(save.from, kv.state(a).unwrap());
    assert_eq!(kv.save_restore_point(a).unwrap(), None, "kept once");
    run(&mut kv, a, 30 - 2 * BT);
    kv.free_sequence(a, true).unwrap();
    let b = SeqId(2);
    let hit = kv.add_sequence(b, &prompt).unwrap();
    assert_eq!(hit.cached_tokens, 2 * BT, "the 3rd full block has no restore point");
    assert_eq!(hit.restore, Some(StateCopy { from: save.to, to: hit.state }));
    // The backend takes the copies (the point's save, then the restore) and makes them: the hit
    // counts once taken.
    assert_eq!(kv.take_state_copies(), [save, hit.restore.unwrap()]);
    assert_eq!(kv.state_stats().restore_hits_total, 1);
    kv.copies_done();
    // A request refused right after its restore was handed out (freed at once) leaves no copy into
    // its slot behind, and no hit counted.
    let c = SeqId(3);
    kv.add_sequence(c, &prompt).unwrap();
    kv.free_sequence(c, false).unwrap();
    assert!(kv.take_state_copies().is_empty());
    assert_eq!(kv.state_stats().restore_hits_total, 1);
    // A stateless model needs none.
    let mut plain = groups([16, 16, 16], 0, 6);
    plain.add_sequence(a, &prompt).unwrap();
    run(&mut plain, a, 30);
    plain.free_sequence(a, true).unwrap();
    assert_eq!(plain.add_sequence(b, &prompt).unwrap().cached_tokens, 3 * BT);
    assert_eq!(plain.save_restore_point(b).unwrap(), None);
    kv.check_invariants().unwrap();
    plain.check_invariants().unwrap();
}

/// A step that was to make a saved point's copy and failed leaves no point behind: a later prefix
/// would resume from a state never written.
#[test]
fn a_restore_point_whose_copy_failed_is_dropped() {
    let mut kv = groups([16, 16, 16], 100, 6);
    let prompt: Vec<u32> = (0..30).collect();
    let a = SeqId(1);
    kv.add_sequence(a, &prompt).unwrap();
    run(&mut kv, a, 2 * BT);
    assert!(kv.save_restore_point(a).unwrap().is_some());
    assert_eq!(kv.take_state_copies().len(), 1);
    kv.copies_failed();
    assert_eq!((kv.lookup_prefix(&prompt), kv.state_stats().restore_points), (0, 0));
    // Saved again and made: it serves.
    assert!(kv.save_restore_point(a).unwrap().is_some());
    kv.take_state_copies();
    kv.copies_done();
    assert_eq!(kv.lookup_prefix(&prompt), 2 * BT);
    kv.check_invariants().unwrap();
}

/// Restore points give way to live requests; a slot is never taken from one.
#[test]
fn state_slots_are_bounded_and_restore_points_give_way() {
    let mut kv = groups([32, 32, 32], 100, 2);
    let a = SeqId(1);
    kv.add_sequence(a, &(0..20).collect::<Vec<u32>>()).unwrap();
    run(&mut kv, a, BT);
    assert!(kv.save_restore_point(a).unwrap().is_some());
    assert_eq!(kv.state_stats().free, 0);
    // Until the backend has made the copy into it, the point keeps its slot (a copy not taken yet
    // is still to come)...
    assert_eq!(kv.add_sequence(SeqId(2), &[7; 9]), Err(KvError::OutOfStates { slots: 2 }));
    kv.copies_done();
    assert_eq!(kv.add_sequence(SeqId(2), &[7; 9]), Err(KvError::OutOfStates { slots: 2 }));
    assert_eq!(kv.take_state_copies().len(), 1);
    kv.copies_done();
    // ... then it makes room for a second request...
    kv.add_sequence(SeqId(2), &[7; 9]).unwrap();
    assert_eq!((kv.state_stats().restore_points, kv.state_stats().restore_points_evicted_total), (0, 1));
    // ... but two live requests hold every slot: a third is refused, nothing changed.
    assert_eq!(kv.add_sequence(SeqId(3), &[8; 9]), Err(KvError::OutOfStates { slots: 2 }));
    assert_eq!(kv.group(0).stats().sequences, 2);
    kv.check_invariants().unwrap();
}

/// A group too small for the next tokens refuses them and no group changes.
#[test]
fn reserve_is_all_or_nothing_across_groups() {
    let mut kv = groups([16, 16, 2], 0, 4);
    let s = SeqId(1);
    kv.add_sequence(s, &(0..40).collect::<Vec<u32>>()).unwrap();
    let before: Vec<usize> = kv.group_stats().iter().map(|g| g.blocks_free).collect();
    assert!(matches!(kv.reserve(s, 40), Err(KvError::OutOfBlocks { needed_blocks: 5, .. })));
    assert_eq!(kv.group_stats().iter().map(|g| g.blocks_free).collect::<Vec<_>>(), before);
    assert!(kv.block_table(s, 0).unwrap().is_empty());
    kv.check_invariants().unwrap();
}

/// The window group gives back what no later query sees; the compressed groups keep every row.
#[test]
fn only_sliding_groups_release_outside_their_window() {
    let mut kv = groups([16, 16, 16], 100, 4);
    let s = SeqId(1);
    kv.add_sequence(s, &(0..40).collect::<Vec<u32>>()).unwrap();
    run(&mut kv, s, 40);
    // A stateful request is cut back only as far as its state goes back (3 positions here: rejected
    // drafts).
    assert!(matches!(kv.truncate(s, 20), Err(KvError::StateRewind { .. })));
    assert!(matches!(kv.truncate(s, 36), Err(KvError::StateRewind { computed: 40, requested: 36, .. })));
    kv.truncate(s, 37).unwrap();
    assert_eq!(kv.computed_tokens(s).unwrap(), 37);
    // Window 13 at 37 tokens: positions 25.. are seen, so blocks 0..3 (tokens 0..24) go.
    assert_eq!(kv.release_outside_windows(s).unwrap(), 3);
    assert!(kv.block_table(s, 0).unwrap()[..3].iter().all(|b| b.is_released()));
    assert!(kv.block_table(s, 1).unwrap().iter().all(|b| !b.is_released()));
    // A released window can be neither recomputed from nor handed over.
    assert!(matches!(kv.truncate(s, 36), Err(KvError::Released { .. })));
    assert!(matches!(kv.lease_sequence(s, TransferId(1), 10), Err(KvError::Released { .. })));
    assert_eq!(kv.group(1).stats().leases, 0, "the refusal left every group as it was");
    kv.check_invariants().unwrap();
}

/// Prefill to decode: the prefill side leases every group's blocks and the state; the decode side
/// takes a destination reusing, per group, what its own prefix cache holds, and adopts it.
#[test]
fn a_grouped_request_moves_as_group_blocks_plus_its_state() {
    let prompt: Vec<u32> = (0..27).collect();
    let mut prefill = groups([16, 16, 16], 100, 4);
    let s = SeqId(1);
    prefill.add_sequence(s, &prompt).unwrap();
    run(&mut prefill, s, 27);
    let state = prefill.state(s).unwrap();
    let lease = prefill.lease_sequence(s, TransferId(5), 1_000).unwrap();
    assert_eq!(lease.state, state);
    let epoch = lease.state_epoch;
    assert_eq!(lease.groups.iter().map(|l| l.blocks.len()).collect::<Vec<_>>(), [4, 4, 4]);
    assert_eq!(prefill.group(2).stats().owned(OwnerKind::Transfer), 4);
    assert!(prefill.check_state_write(TransferId(5), state, epoch).is_ok());

    let mut decode = groups([16, 16, 16], 100, 4);
    // The decode side holds the prompt's first block already (an earlier request's), in every group.
    let d0 = SeqId(9);
    decode.add_sequence(d0, &prompt[..BT + 1]).unwrap();
    run(&mut decode, d0, BT + 1);
    decode.free_sequence(d0, true).unwrap();
    let dest = decode.allocate_lease_reusing(TransferId(5), &prompt, 2_000).unwrap();
    // Only blocks[reused..] of each group travel, and the state.
    assert_eq!(dest.groups.iter().map(|l| (l.reused, l.blocks.len())).collect::<Vec<_>>(), [(1, 4); 3]);
    assert_eq!(decode.group(0).stats().owned(OwnerKind::Transfer), 4);
    decode.adopt_lease(TransferId(5), SeqId(1), &prompt).unwrap();
    assert_eq!(decode.computed_tokens(SeqId(1)).unwrap(), 27);
    prefill.release_lease(TransferId(5)).unwrap();
    // A late write of the ended lease's state is refused, whoever takes the slot next.
    assert!(prefill.check_state_write(TransferId(5), state, epoch).is_err());
    assert_eq!(prefill.state_stats().free, 4);
    prefill.check_invariants().unwrap();
    decode.check_invariants().unwrap();
}

/// Thousands of random operations on stateful and stateless groups; invariants and the modelled
/// bytes checked after each; everything comes back at the end; restore points are actually used.
#[test]
fn randomized_group_operations_keep_every_invariant() {
    let mut restores = 0;
    for seed in 1..=16u64 {
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let mut bytes = std::iter::from_fn(move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            Some((state >> 24) as u8)
        });
        let blocks = [[48, 40, 32], [12, 48, 48], [48, 48, 10], [20, 20, 20]][seed as usize % 4];
        let (state_bytes, slots) = if seed % 3 == 0 { (0, 12) } else { (64, [6, 12, 20][seed as usize % 3]) };
        let mut d = GroupDriver::new(config(blocks, state_bytes, slots)).unwrap();
        for _ in 0..2_000 {
            d.apply(GroupOp::decode(&mut bytes).unwrap());
        }
        restores += d.restores;
        d.drain();
    }
    assert!(restores >= 10, "only {restores} restores: the property is not exercised");
}
