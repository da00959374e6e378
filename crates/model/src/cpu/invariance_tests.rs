//! Batch invariance on a small random model, for every weight format and the kernel family this
//! process runs (`cargo xtask test` runs the crate's tests under each family): every position's
//! logits are the same bits whether its prompt is computed in one step, in a prefix-cache hit's
//! tail beside another sequence's prefill chunk, or token by token as decode steps.

use std::sync::Arc;

use pdserve_kvcache::{KvCache, KvConfig, SeqId};

use crate::{Backend, CpuBackend, KvDtype, ModelConfig, SeqStep, WeightFormat, Weights};

fn config() -> ModelConfig {
    ModelConfig {
        hidden_size: 128,
        intermediate_size: 256,
        num_layers: 2,
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 64,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        max_position_embeddings: 2048,
        vocab_size: 96,
        tie_word_embeddings: true,
        qkv_bias: false,
        o_bias: false,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        rope_scaling: crate::RopeScaling::None,
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
    Weights::random(c, false, 0x2545_f491_4f6c_dd1d, 0.4)
}

const BLOCK: usize = 16;

/// A fresh backend and its cache; sequences are added as the scenarios need them.
fn fresh(format: WeightFormat, int8: bool, dtype: KvDtype) -> (CpuBackend, KvCache) {
    let c = config();
    let cpu = CpuBackend::with_kv_dtype(c.clone(), Arc::new(weights(&c)), 128, BLOCK, dtype)
        .with_weight_format(format)
        .expect("format")
        .with_int8_activations(int8);
    (cpu, KvCache::new(KvConfig { num_blocks: 128, block_size: BLOCK as u32 }).unwrap())
}

/// Runs steps of `(sequence, tokens from, tokens to)` on one backend, every row asking for logits;
/// returns each sequence's logits by position.
fn run(
    cpu: &mut CpuBackend,
    kv: &mut KvCache,
    prompts: &[&[u32]],
    steps: &[Vec<(usize, usize, usize)>],
) -> Vec<Vec<Vec<f32>>> {
    for (i, p) in prompts.iter().enumerate() {
        kv.add_sequence(SeqId(i as u64), p).unwrap();
    }
    let mut out: Vec<Vec<Vec<f32>>> = prompts.iter().map(|p| vec![Vec::new(); p.len()]).collect();
    for step in steps {
        let tables: Vec<Vec<_>> = step
            .iter()
            .map(|&(s, from, to)| {
                kv.reserve(SeqId(s as u64), to - from).unwrap();
                kv.block_table(SeqId(s as u64)).unwrap().to_vec()
            })
            .collect();
        let seq_steps: Vec<SeqStep<'_>> = step
            .iter()
            .zip(&tables)
            .map(|(&(s, from, to), t)| SeqStep {
                tokens: &prompts[s][from..to],
                start_pos: from,
                block_table: t,
                logits: to - from,
                state: None,
            })
            .collect();
        let mut rows = cpu.forward(&seq_steps).unwrap().into_iter();
        for &(s, from, to) in step {
            for row in &mut out[s][from..to] {
                *row = rows.next().unwrap();
            }
            kv.commit(SeqId(s as u64), to - from).unwrap();
        }
    }
    out
}

#[test]
fn every_position_computes_the_same_bits_whatever_its_step_holds() {
    let a: Vec<u32> = (0..530u32).map(|i| 3 + (i * 37 + i / 7) % 90).collect();
    let b: Vec<u32> = (0..45u32).map(|i| 5 + (i * 11) % 80).collect();
    let cases = [
        (WeightFormat::F32, false),
        (WeightFormat::Bf16, false),
        (WeightFormat::F16, false),
        (WeightFormat::Fp8, false),
        (WeightFormat::Fp4, false),
        (WeightFormat::Q8, false),
        (WeightFormat::Q4, false),
        (WeightFormat::Q4, true),
    ];
    for (format, int8) in cases {
        for dtype in [KvDtype::F16, KvDtype::F32] {
            let name = format!("{format:?} int8 {int8} {dtype:?} kv ({:?})", crate::sys::cpu_kernels());
            // Cold: the whole prompt in one step.
            let (mut cpu, mut kv) = fresh(format, int8, dtype);
            let cold = run(&mut cpu, &mut kv, &[&a], &[vec![(0, 0, a.len())]]);
            // A prefix hit's tail beside another sequence's prefill chunk: the first 512 positions in
            // one step, the last 18 with b's 45.
            let (mut cpu, mut kv) = fresh(format, int8, dtype);
            let steps = vec![vec![(0, 0, 512)], vec![(1, 0, 45), (0, 512, a.len())]];
            let tail = run(&mut cpu, &mut kv, &[&a, &b], &steps);
            // Decode: 100 positions in one step, then one a step, beside b's prompt in chunks of 7.
            let (mut cpu, mut kv) = fresh(format, int8, dtype);
            let mut steps = vec![vec![(0, 0, 100)]];
            for pos in 100..a.len() {
                let mut step = vec![(0, pos, pos + 1)];
                let chunk = (pos - 100) * 7;
                if chunk < b.len() {
                    step.insert(0, (1, chunk, (chunk + 7).min(b.len())));
                }
                steps.push(step);
            }
            let decode = run(&mut cpu, &mut kv, &[&a, &b], &steps);
            for pos in 0..a.len() {
                for (what, other) in [("tail", &tail[0][pos]), ("decode", &decode[0][pos])] {
                    let same = cold[0][pos].iter().zip(other).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "{name}: position {pos} cold and {what} differ");
                }
            }
            for pos in 0..b.len() {
                let same = tail[1][pos].iter().zip(&decode[1][pos]).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{name}: b's position {pos} differs between its chunkings");
            }
        }
    }
}

/// Where the AVX2 kernels run without AVX-512 BF16, bf16 weights lie row-major and every product
/// widens them exactly as it reads them: a checkpoint whose values are bf16 gives, served in bf16,
/// the logits of its f32 copy bit for bit, in a whole-prompt step and in decode steps alike, at
/// half the bytes.
#[test]
fn bf16_rows_give_the_bits_of_the_f32_copy() {
    if crate::sys::has_bf16_gemm() || !crate::sys::avx2() {
        return;
    }
    use crate::bits16::{bf16_bits, bf16_value};
    let c = config();
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let w = Arc::new(Weights::filled(&c, false, &mut |n| {
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                bf16_value(bf16_bits(((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.4))
            })
            .collect()
    }));
    let a: Vec<u32> = (0..200u32).map(|i| 3 + (i * 37 + i / 7) % 90).collect();
    let logits = |format: WeightFormat| {
        let cpu = CpuBackend::with_kv_dtype(c.clone(), Arc::clone(&w), 128, BLOCK, KvDtype::F16);
        let mut cpu = cpu.with_weight_format(format).expect("format");
        let mut kv = KvCache::new(KvConfig { num_blocks: 128, block_size: BLOCK as u32 }).unwrap();
        let mut steps = vec![vec![(0, 0, 150)]];
        steps.extend((150..a.len()).map(|p| vec![(0, p, p + 1)]));
        (run(&mut cpu, &mut kv, &[&a], &steps), cpu.multi_row_format())
    };
    let (want, _) = logits(WeightFormat::F32);
    let (got, format) = logits(WeightFormat::Bf16);
    assert_eq!(format, "bf16");
    for pos in 0..a.len() {
        let same = want[0][pos].iter().zip(&got[0][pos]).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "position {pos}: bf16 rows and the f32 copy differ");
    }
}
