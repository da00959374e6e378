//! A tiny random-weight model built by the test itself: fast checks of the forward pass's invariants,
//! its input validation, KV block copies, and of loading errors that name the file.

use std::sync::Arc;

use pdserve_kvcache::{BlockId, KvCache, KvConfig, SeqId};
use pdserve_model::{Backend, CpuBackend, KvDtype, ModelConfig, ModelError, ModelFiles, SeqStep, Weights};

fn config() -> ModelConfig {
    ModelConfig {
        hidden_size: 32,
        intermediate_size: 48,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        max_position_embeddings: 128,
        vocab_size: 50,
        tie_word_embeddings: true,
        qkv_bias: true,
        o_bias: false,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        rope_scaling: pdserve_model::RopeScaling::None,
        qk_norm: false,
        sliding_window: None,
        moe: None,
        mla: None,
        draft_layers: 0,
        v4: None,
        fp8_block: None,
        fp4_group: None,
    }
}

fn weights(c: &ModelConfig) -> Weights {
    Weights::random(c, true, 0x1234_5678_9abc_def1, 0.5)
}

fn backend(num_blocks: usize, block_size: usize) -> CpuBackend {
    let c = config();
    let w = weights(&c);
    CpuBackend::new(c, Arc::new(w), num_blocks, block_size)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Runs `tokens` through `cpu` in chunks of the given sizes; returns the last logits.
fn prefill(cpu: &mut CpuBackend, tokens: &[u32], chunks: &[usize]) -> Vec<f32> {
    let bs = cpu.kv_layout().block_size;
    let mut kv =
        KvCache::new(KvConfig { num_blocks: cpu.kv_layout().num_blocks as u32, block_size: bs as u32 })
            .unwrap();
    let s = SeqId(1);
    kv.add_sequence(s, tokens).unwrap();
    let mut last = Vec::new();
    for &n in chunks {
        let start = kv.computed_tokens(s).unwrap();
        kv.reserve(s, n).unwrap();
        let table = kv.block_table(s).unwrap().to_vec();
        last = cpu
            .forward(&[SeqStep {
                tokens: &tokens[start..start + n],
                start_pos: start,
                block_table: &table,
                logits: 1,
                state: None,
            }])
            .unwrap()
            .remove(0);
        kv.commit(s, n).unwrap();
    }
    last
}

#[test]
fn chunking_and_block_size_do_not_change_logits() {
    let tokens: Vec<u32> = (0..40).map(|i| (i * 7 % 50) as u32).collect();
    let whole = prefill(&mut backend(16, 4), &tokens, &[40]);
    for (bs, chunks) in [(4, vec![1, 3, 17, 19]), (1, vec![40]), (16, vec![20, 20]), (4, vec![1; 40])] {
        let got = prefill(&mut backend(64, bs), &tokens, &chunks);
        assert!(
            max_diff(&whole, &got) < 1e-4,
            "block size {bs}, chunks {chunks:?}: {}",
            max_diff(&whole, &got)
        );
    }
}

/// A prompt's last layer finishes only the rows whose logits are wanted: a chunk that wants none
/// still leaves every layer's K and V of its tokens for the chunks after it, and a step's one row of
/// logits is what asking for all of them gives for that row.
#[test]
fn rows_without_logits_still_leave_their_kv() {
    let tokens: Vec<u32> = (0..40).map(|i| (i * 13 % 50) as u32).collect();
    let whole = prefill(&mut backend(16, 4), &tokens, &[40]);
    let mut cpu = backend(16, 4);
    let table: Vec<BlockId> = (0..10).map(BlockId).collect();
    let mut start = 0;
    for (n, logits) in [(17, 0), (20, 0), (3, 1)] {
        let step = SeqStep {
            tokens: &tokens[start..start + n],
            start_pos: start,
            block_table: &table,
            logits,
            state: None,
        };
        let out = cpu.forward(&[step]).unwrap();
        assert_eq!(out.len(), logits);
        if logits == 1 {
            assert!(max_diff(&whole, &out[0]) < 1e-4, "{}", max_diff(&whole, &out[0]));
        }
        start += n;
    }
    let mut all = backend(16, 4);
    let step =
        SeqStep { tokens: &tokens, start_pos: 0, block_table: &table, logits: tokens.len(), state: None };
    let every = all.forward(&[step]).unwrap();
    assert_eq!(every.len(), 40);
    assert!(max_diff(&whole, &every[39]) < 1e-4, "{}", max_diff(&whole, &every[39]));
}

/// Speculative decoding's verification: a step of several tokens asking for the logits of its last
/// rows gives, row by row, exactly what decoding those tokens one at a time gives; and asking for more rows
/// than tokens is an error.
#[test]
fn rows_of_logits_match_one_token_at_a_time() {
    let tokens: Vec<u32> = (0..30).map(|i| (i * 11 % 50) as u32).collect();
    let (prompt, drafted) = tokens.split_at(24);
    let mut one = backend(16, 4);
    prefill(&mut one, prompt, &[24]);
    let table: Vec<BlockId> = (0..8).map(BlockId).collect();
    let singles: Vec<Vec<f32>> = drafted
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let step = SeqStep {
                tokens: std::slice::from_ref(t),
                start_pos: 24 + i,
                block_table: &table,
                logits: 1,
                state: None,
            };
            one.forward(&[step]).unwrap().remove(0)
        })
        .collect();
    let mut rows = backend(16, 4);
    prefill(&mut rows, prompt, &[24]);
    let step =
        SeqStep { tokens: drafted, start_pos: 24, block_table: &table, logits: drafted.len(), state: None };
    let other =
        SeqStep { tokens: &prompt[..3], start_pos: 0, block_table: &table[6..], logits: 1, state: None };
    let got = rows.forward(&[other, step]).unwrap();
    assert_eq!(got.len(), 1 + drafted.len());
    for (i, (a, b)) in singles.iter().zip(&got[1..]).enumerate() {
        // Exactly: a decode-sized step computes each row as a one-row step does.
        assert_eq!(a, b, "row {i}: {}", max_diff(a, b));
    }
    let too_many =
        SeqStep { tokens: &drafted[..2], start_pos: 24, block_table: &table, logits: 3, state: None };
    assert!(matches!(rows.forward(&[too_many]), Err(ModelError::InvalidInput { .. })));
}

#[test]
fn batch_rows_do_not_leak_into_each_other() {
    let mut cpu = backend(32, 4);
    let a: Vec<u32> = vec![3, 4, 5, 6, 7, 8, 9];
    let b: Vec<u32> = vec![10, 11, 12];
    let alone_a = prefill(&mut cpu, &a, &[7]);
    let alone_b = prefill(&mut cpu, &b, &[3]);
    let mut kv = KvCache::new(KvConfig { num_blocks: 32, block_size: 4 }).unwrap();
    for (i, t) in [&a, &b].iter().enumerate() {
        kv.add_sequence(SeqId(i as u64), t).unwrap();
        kv.reserve(SeqId(i as u64), t.len()).unwrap();
    }
    let (ta, tb) = (kv.block_table(SeqId(0)).unwrap().to_vec(), kv.block_table(SeqId(1)).unwrap().to_vec());
    let out = cpu
        .forward(&[
            SeqStep { tokens: &a, start_pos: 0, block_table: &ta, logits: 1, state: None },
            SeqStep { tokens: &b, start_pos: 0, block_table: &tb, logits: 0, state: None },
        ])
        .unwrap();
    assert_eq!(out.len(), 1, "logits only where asked");
    assert!(max_diff(&out[0], &alone_a) < 1e-4);
    let out = cpu
        .forward(&[
            SeqStep { tokens: &b, start_pos: 0, block_table: &tb, logits: 1, state: None },
            SeqStep { tokens: &a, start_pos: 0, block_table: &ta, logits: 1, state: None },
        ])
        .unwrap();
    assert!(max_diff(&out[0], &alone_b) < 1e-4 && max_diff(&out[1], &alone_a) < 1e-4);
}

#[test]
fn copied_blocks_continue_identically() {
    // A fork's copy-on-write: decoding from copied KV gives the same logits as from the original.
    let mut cpu = backend(16, 4);
    let prompt: Vec<u32> = vec![5, 6, 7, 8, 9, 10];
    let mut kv = KvCache::new(KvConfig { num_blocks: 16, block_size: 4 }).unwrap();
    kv.add_sequence(SeqId(1), &prompt).unwrap();
    kv.reserve(SeqId(1), 6).unwrap();
    let table = kv.block_table(SeqId(1)).unwrap().to_vec();
    cpu.forward(&[SeqStep { tokens: &prompt, start_pos: 0, block_table: &table, logits: 0, state: None }])
        .unwrap();
    kv.commit(SeqId(1), 6).unwrap();
    kv.fork(SeqId(1), SeqId(2)).unwrap();
    for s in [SeqId(1), SeqId(2)] {
        kv.append_tokens(s, &[11]).unwrap();
        kv.reserve(s, 1).unwrap();
    }
    let copies = kv.take_copies();
    assert_eq!(copies.len(), 1);
    cpu.copy_blocks(&copies).unwrap();
    assert_eq!(block(&cpu, copies[0].dst), block(&cpu, copies[0].src), "whole block copied");
    let out: Vec<Vec<f32>> = [SeqId(1), SeqId(2)]
        .iter()
        .map(|&s| {
            let t = kv.block_table(s).unwrap().to_vec();
            cpu.forward(&[SeqStep { tokens: &[11], start_pos: 6, block_table: &t, logits: 1, state: None }])
                .unwrap()
                .remove(0)
        })
        .collect();
    assert!(max_diff(&out[0], &out[1]) < 1e-6);
}

#[test]
fn invalid_steps_are_errors_not_panics() {
    let mut cpu = backend(4, 4);
    let table = [BlockId(0), BlockId(1)];
    let cases: Vec<(Vec<u32>, usize, Vec<BlockId>)> = vec![
        (vec![], 0, table.to_vec()),
        (vec![50], 0, table.to_vec()),
        (vec![1; 9], 0, table.to_vec()),
        (vec![1], 127, vec![BlockId(0); 32]),
        (vec![1, 2], 127, vec![BlockId(0); 33]),
        (vec![1], 0, vec![BlockId(9)]),
    ];
    for (tokens, start, table) in cases {
        let r = cpu.forward(&[SeqStep {
            tokens: &tokens,
            start_pos: start,
            block_table: &table,
            logits: 1,
            state: None,
        }]);
        match (tokens.len(), start, r) {
            (1, 127, Ok(_)) => {}
            (_, _, Err(ModelError::InvalidInput { .. })) => {}
            (n, s, other) => panic!("{n} tokens at {s}: {other:?}"),
        }
    }
}

#[test]
fn loading_errors_name_the_file() {
    let dir = std::env::temp_dir().join(format!("pdserve-model-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let err = ModelFiles::load(&dir).unwrap_err().to_string();
    assert!(err.contains("config.json"), "{err}");
    std::fs::write(dir.join("config.json"), "{not json").unwrap();
    let err = ModelFiles::load(&dir).unwrap_err().to_string();
    assert!(err.contains("config.json"), "{err}");
    std::fs::write(
        dir.join("config.json"),
        r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
            "num_attention_heads": 4, "max_position_embeddings": 64, "vocab_size": 50}"#,
    )
    .unwrap();
    let err = ModelFiles::load(&dir).unwrap_err().to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
    let err = ModelFiles::load(&dir.join("nope")).unwrap_err().to_string();
    assert!(err.contains("not a directory"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// KV memory from outside: bytes at an offset of a vector (4-aligned unless told otherwise).
#[derive(Debug)]
struct Store {
    bytes: Vec<u8>,
    at: usize,
    len: usize,
}

impl Store {
    fn new(len: usize, misalign: usize) -> Store {
        let bytes = vec![0u8; len + 8];
        let at = bytes.as_ptr().align_offset(4) + misalign;
        Store { bytes, at, len }
    }
}

impl pdserve_model::KvStore for Store {
    fn bytes(&self) -> &[u8] {
        &self.bytes[self.at..self.at + self.len]
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.bytes[self.at..self.at + self.len]
    }
}

#[test]
fn kv_memory_from_outside_computes_the_same_and_holds_the_blocks() {
    let c = config();
    let need = backend(8, 4).kv_layout().block_bytes() * 8;
    let store = |len, misalign, dtype| {
        let store = Box::new(Store::new(len, misalign));
        CpuBackend::with_kv_store(c.clone(), Arc::new(weights(&c)), (8, 4), dtype, store)
    };
    let mut cpu = store(need, 0, KvDtype::F32).unwrap();
    let heap = prefill(&mut backend(8, 4), &[1, 2, 3, 4, 5], &[5]);
    let outside = prefill(&mut cpu, &[1, 2, 3, 4, 5], &[5]);
    assert!(max_diff(&heap, &outside) < 1e-6, "the store computes the same");
    assert!(block(&cpu, BlockId(0)).iter().any(|&b| b != 0), "the prompt's KV is in the store");
    assert!(store(need - 4, 0, KvDtype::F32).is_err(), "a store too small for the pool");
    assert!(store(need, 1, KvDtype::F32).is_err(), "a store not aligned for f32");
    let mut half = store(need / 2, 0, KvDtype::F16).expect("f16 blocks take half the bytes");
    let heap16 = prefill(&mut sixteen_bit(KvDtype::F16, 8, 4), &[1, 2, 3, 4, 5], &[5]);
    assert!(max_diff(&heap16, &prefill(&mut half, &[1, 2, 3, 4, 5], &[5])) < 1e-6);
}

fn sixteen_bit(dtype: KvDtype, num_blocks: usize, block_size: usize) -> CpuBackend {
    let c = config();
    let w = weights(&c);
    CpuBackend::with_kv_dtype(c, Arc::new(w), num_blocks, block_size, dtype)
}

/// f16 and bf16 KV: half the bytes per block; the logits of a prefill (GEMM attention) and of the
/// single-token steps after it (decode attention) stay within the type's rounding of f32's, and do not
/// depend on how the prompt was chunked (every value is rounded once, when stored).
#[test]
fn sixteen_bit_kv_stays_within_rounding_of_f32() {
    let tokens: Vec<u32> = (0..48).map(|i| (i * 11 % 50) as u32).collect();
    let f32_bytes = backend(16, 4).kv_layout().block_bytes();
    let reference = prefill(&mut backend(16, 4), &tokens, &[40, 1, 1, 1, 1, 1, 1, 1, 1]);
    for (dtype, tolerance) in [(KvDtype::F16, 2e-3), (KvDtype::Bf16, 2e-2)] {
        assert_eq!(sixteen_bit(dtype, 16, 4).kv_layout().block_bytes() * 2, f32_bytes);
        let got = prefill(&mut sixteen_bit(dtype, 16, 4), &tokens, &[40, 1, 1, 1, 1, 1, 1, 1, 1]);
        let d = max_diff(&reference, &got);
        assert!(d > 0.0 && d < tolerance, "{dtype:?}: {d}");
        let chunked = prefill(&mut sixteen_bit(dtype, 64, 4), &tokens, &[3, 17, 1, 27]);
        assert!(max_diff(&got, &chunked) < 1e-4, "{dtype:?} chunked: {}", max_diff(&got, &chunked));
    }
}

/// One block's KV read through the backend.
fn block(cpu: &CpuBackend, b: BlockId) -> Vec<u8> {
    let mut out = vec![0; cpu.kv_layout().block_bytes()];
    cpu.read_block(b, &mut out).unwrap();
    out
}

#[test]
fn block_reads_and_writes_are_checked_and_round_trip() {
    let mut cpu = backend(8, 4);
    let n = cpu.kv_layout().block_bytes();
    let data: Vec<u8> = (0..n / 4).flat_map(|i| (i as f32 * 0.5).to_le_bytes()).collect();
    cpu.write_block(BlockId(3), &data).unwrap();
    assert_eq!(block(&cpu, BlockId(3)), data);
    assert!(block(&cpu, BlockId(2)).iter().all(|&v| v == 0), "neighbours untouched");
    assert!(cpu.write_block(BlockId(8), &data).is_err(), "block outside the pool");
    assert!(cpu.write_block(BlockId(0), &data[1..]).is_err(), "short buffer");
    let mut short = vec![0; n - 1];
    assert!(cpu.read_block(BlockId(0), &mut short).is_err());
    let outside = pdserve_kvcache::BlockCopy { src: BlockId(0), dst: BlockId(8), tokens: 1 };
    assert!(cpu.copy_blocks(&[outside]).is_err(), "a copy outside the pool is an error, not a panic");
}
