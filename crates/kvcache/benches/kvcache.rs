//! Allocation and prefix-match throughput.
//!
//! - allocate/free: a 4,096-token sequence reserved (256 blocks of 16) and freed, per block;
//! - decode append: reserve + commit one token at a time, per token;
//! - prefix match: a 4,096-token prompt against a cache holding over 100,000 blocks, per match, both the
//!   read-only lookup and the admission path (match + reference + release).
//!
//! Run: `cargo bench -p pdserve-kvcache`. Writes `target/bench/kvcache.json`.

use std::hint::black_box;
use std::time::Instant;

use pdserve_kvcache::{KvCache, KvConfig, SeqId};

const BS: u32 = 16;
const PROMPT: usize = 4096;

/// Median of `samples` runs of `f`, each timing `iters` iterations; returns nanoseconds per iteration.
fn measure(samples: usize, iters: usize, mut f: impl FnMut(usize)) -> f64 {
    let mut v: Vec<f64> = (0..samples)
        .map(|_| {
            let t = Instant::now();
            for i in 0..iters {
                f(i);
            }
            t.elapsed().as_nanos() as f64 / iters as f64
        })
        .collect();
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn prompt(k: u32) -> Vec<u32> {
    // A 512-token system prompt shared by all, then a tail unique to prompt k.
    (0..PROMPT as u32).map(|i| if i < 512 { i } else { 1_000_000 + k * 10_000 + i }).collect()
}

fn main() {
    // Allocate / free.
    let mut kv = KvCache::new(KvConfig { num_blocks: 4096, block_size: BS }).expect("config");
    let p = prompt(0);
    let blocks = PROMPT / BS as usize;
    let alloc_ns = measure(11, 200, |i| {
        let s = SeqId(i as u64);
        kv.add_sequence(s, &p).expect("add");
        kv.reserve(s, PROMPT).expect("reserve");
        kv.free_sequence(s, false).expect("free");
    }) / blocks as f64;

    let mut kv = KvCache::new(KvConfig { num_blocks: 4096, block_size: BS }).expect("config");
    kv.add_sequence(SeqId(1), &[1]).expect("add");
    let decode_ns = measure(11, 20_000, |i| {
        if i == 0 {
            kv.truncate(SeqId(1), 1).expect("truncate");
        }
        kv.append_tokens(SeqId(1), &[7]).expect("append");
        kv.reserve(SeqId(1), 1).expect("reserve");
        kv.commit(SeqId(1), 1).expect("commit");
    });

    // Fill the prefix cache with > 100,000 blocks.
    let n_prompts = 450u32;
    let mut kv = KvCache::new(KvConfig { num_blocks: 110_000, block_size: BS }).expect("config");
    let fill = Instant::now();
    for k in 0..n_prompts {
        let s = SeqId(u64::from(k));
        let p = prompt(k);
        let hit = kv.add_sequence(s, &p).expect("add");
        kv.reserve(s, PROMPT - hit.cached_tokens).expect("reserve");
        kv.commit(s, PROMPT - hit.cached_tokens).expect("commit");
        kv.free_sequence(s, true).expect("free");
    }
    let fill_s = fill.elapsed().as_secs_f64();
    let cached = kv.stats().blocks_owned[1];
    assert!(cached >= 100_000, "cache holds {cached} blocks");
    let probe = prompt(n_prompts / 2);
    assert_eq!(kv.lookup_prefix(&probe), PROMPT - BS as usize);
    let lookup_ns = measure(11, 2_000, |_| {
        black_box(kv.lookup_prefix(black_box(&probe)));
    });
    let admit_ns = measure(11, 2_000, |i| {
        let s = SeqId(1_000_000 + i as u64);
        black_box(kv.add_sequence(s, &probe).expect("add"));
        kv.free_sequence(s, false).expect("free");
    });
    kv.check_invariants().expect("invariants");

    println!("block size {BS} tokens");
    println!("allocate+free                     {alloc_ns:>10.1} ns/block   (target < 100)");
    println!("decode append (reserve+commit)    {decode_ns:>10.1} ns/token");
    println!(
        "prefix lookup, 4096-token prompt  {:>10.2} us/match   vs {cached} cached blocks (target < 10)",
        lookup_ns / 1e3
    );
    println!("admission (match+ref+release)     {:>10.2} us/request", admit_ns / 1e3);
    println!("cache fill: {n_prompts} prompts in {fill_s:.2} s");
    let json = format!(
        "{{\"bench\":\"kvcache\",\"block_size\":{BS},\"alloc_free_ns_per_block\":{alloc_ns:.1},\
         \"decode_append_ns_per_token\":{decode_ns:.1},\"prefix_lookup_us\":{:.3},\"admission_us\":{:.3},\
         \"cached_blocks\":{cached}}}\n",
        lookup_ns / 1e3,
        admit_ns / 1e3
    );
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/bench");
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(dir.join("kvcache.json"), json);
}
