//! Speed of the CPU forward pass on the default model: single-sequence decode (f32, Q8 and Q4 weights),
//! prefill of a 1,000-token prompt (f32, and Q4 whose multi-row steps widen its blocks to bf16) and of
//! 24 prompts of 83 tokens in one step (Q4), and
//! aggregate decode with 8 and 32 sequences in one batch (f32; 4, 8 and 32 with Q4), and Q4 decode after a
//! 4,000-token prompt and of 32 sequences of 1,000 tokens, with f32 KV and with f16 KV (the server's
//! default, where attention reads half the bytes), and what verifying 4 or 8 draft tokens costs against
//! a one-token step (speculative decoding), and Q4 decode and prefill with int8 activations
//! (`with_int8_activations`, names with `int8`). f32 KV unless a name says f16. Uses rayon's pool
//! (one thread per core). Run: `cargo bench -p pdserve-model` (`-- --quick` for fewer tokens,
//! `-- --only batch,prefill` for the figures whose names contain either). Writes
//! `target/bench/model-forward.json`.

use std::sync::Arc;
use std::time::Instant;

use pdserve_import::fetch::{ensure_default_model, models_dir};
use pdserve_import::Silent;
use pdserve_kvcache::{KvCache, KvConfig, SeqId};
use pdserve_model::{Backend, CpuBackend, KvDtype, ModelFiles, SeqStep};

const BS: usize = 16;

struct Bench {
    cpu: CpuBackend,
    kv: KvCache,
}

impl Bench {
    /// Adds sequence `i` with a prompt of `len` tokens of its own and room for them; the prompt and
    /// its block table.
    fn add_prompt(&mut self, i: usize, len: usize) -> (Vec<u32>, Vec<pdserve_kvcache::BlockId>) {
        let s = SeqId(i as u64);
        let prompt: Vec<u32> = (0..len).map(|j| ((i * 131 + j * 17) % 40_000 + 100) as u32).collect();
        self.kv.add_sequence(s, &prompt).expect("add");
        self.kv.reserve(s, len).expect("reserve");
        let table = self.kv.block_table(s).expect("table").to_vec();
        (prompt, table)
    }

    /// Prefills `n` sequences of `prompt_len` tokens (one step each); returns the seconds it took.
    fn prefill(&mut self, n: usize, prompt_len: usize) -> f64 {
        let t = Instant::now();
        for i in 0..n {
            let s = SeqId(i as u64);
            let (prompt, table) = self.add_prompt(i, prompt_len);
            self.cpu
                .forward(&[SeqStep {
                    tokens: &prompt,
                    start_pos: 0,
                    block_table: &table,
                    logits: 1,
                    state: None,
                }])
                .expect("forward");
            self.kv.commit(s, prompt_len).expect("commit");
        }
        t.elapsed().as_secs_f64()
    }

    /// Prefills one sequence of `prompt_len` tokens in chunks of `chunk` (one step each, as the
    /// server's scheduler steps them); returns the seconds it took.
    fn prefill_chunked(&mut self, prompt_len: usize, chunk: usize) -> f64 {
        let s = SeqId(0);
        let (prompt, table) = self.add_prompt(0, prompt_len);
        let t = Instant::now();
        for start in (0..prompt_len).step_by(chunk) {
            let end = (start + chunk).min(prompt_len);
            let logits = usize::from(end == prompt_len);
            self.cpu
                .forward(&[SeqStep {
                    tokens: &prompt[start..end],
                    start_pos: start,
                    block_table: &table,
                    logits,
                    state: None,
                }])
                .expect("forward");
        }
        let took = t.elapsed().as_secs_f64();
        self.kv.commit(s, prompt_len).expect("commit");
        took
    }

    /// Prefills `n` sequences of `prompt_len` tokens in one step (as a server's step admits a burst
    /// of requests); returns the seconds it took.
    fn prefill_together(&mut self, n: usize, prompt_len: usize) -> f64 {
        let mut inputs = Vec::with_capacity(n);
        for i in 0..n {
            inputs.push(self.add_prompt(i, prompt_len));
        }
        let steps: Vec<SeqStep<'_>> = inputs
            .iter()
            .map(|(t, b)| SeqStep { tokens: t, start_pos: 0, block_table: b, logits: 1, state: None })
            .collect();
        let t = Instant::now();
        self.cpu.forward(&steps).expect("forward");
        let took = t.elapsed().as_secs_f64();
        for i in 0..n {
            self.kv.commit(SeqId(i as u64), prompt_len).expect("commit");
        }
        took
    }

    /// Prefills `reps + 1` sequences of `prompt_len` tokens of their own, one after another, in
    /// 512-token chunks (as the server's scheduler steps them), on this one backend; the median seconds
    /// per prompt of the last `reps` (the first warms the scratch buffers, as a serving process's
    /// first request does).
    fn prefill_warm(&mut self, prompt_len: usize, reps: usize) -> f64 {
        let mut times: Vec<f64> = (0..=reps)
            .map(|i| {
                let s = SeqId(i as u64);
                let (prompt, table) = self.add_prompt(i, prompt_len);
                let t = Instant::now();
                for (c, chunk) in prompt.chunks(512).enumerate() {
                    let last = (c + 1) * 512 >= prompt_len;
                    let step = SeqStep {
                        tokens: chunk,
                        start_pos: c * 512,
                        block_table: &table,
                        logits: usize::from(last),
                        state: None,
                    };
                    self.cpu.forward(&[step]).expect("forward");
                }
                self.kv.commit(s, prompt_len).expect("commit");
                t.elapsed().as_secs_f64()
            })
            .skip(1)
            .collect();
        times.sort_by(f64::total_cmp);
        times[reps / 2]
    }

    /// Prefills sequence 0 to position `at` in 512-token chunks, then times one more chunk of `n`
    /// tokens from there (what a scheduler's step costs at that context).
    fn chunk_at(&mut self, at: usize, n: usize) -> f64 {
        let s = SeqId(0);
        let prompt: Vec<u32> = (0..at + n).map(|j| ((j * 17) % 40_000 + 100) as u32).collect();
        self.kv.add_sequence(s, &prompt).expect("add");
        let mut pos = 0;
        let mut last = 0.0;
        while pos < at + n {
            let len = if pos < at { (at - pos).min(512) } else { n };
            self.kv.reserve(s, len).expect("reserve");
            let table = self.kv.block_table(s).expect("table").to_vec();
            let t = Instant::now();
            let step = SeqStep {
                tokens: &prompt[pos..pos + len],
                start_pos: pos,
                block_table: &table,
                logits: 1,
                state: None,
            };
            self.cpu.forward(&[step]).expect("forward");
            last = t.elapsed().as_secs_f64();
            self.kv.commit(s, len).expect("commit");
            pos += len;
        }
        last
    }

    /// Prefills sequence 0 to position `at`, then times `reps` steps of `n` tokens at that position (the
    /// same slots each time), asking for logits of every row (a decode with `n - 1` drafts to verify);
    /// the median seconds per step.
    fn verify_at(&mut self, at: usize, n: usize, reps: usize) -> f64 {
        self.verify_sizes_at(at, &[n], reps)[0]
    }

    /// Prefills sequence 0 to position `at`, then times steps of each of `ns` tokens at that position
    /// in turn (the same slots each time, logits of every row), `reps` rounds, on this one backend
    /// (so the machine's swings hit every size alike); the median seconds per step of each.
    fn verify_sizes_at(&mut self, at: usize, ns: &[usize], reps: usize) -> Vec<f64> {
        let s = SeqId(0);
        let most = ns.iter().copied().max().unwrap_or(1);
        let prompt: Vec<u32> = (0..at + most).map(|j| ((j * 17) % 40_000 + 100) as u32).collect();
        self.kv.add_sequence(s, &prompt).expect("add");
        self.kv.reserve(s, at + most).expect("reserve");
        let table = self.kv.block_table(s).expect("table").to_vec();
        let step =
            SeqStep { tokens: &prompt[..at], start_pos: 0, block_table: &table, logits: 0, state: None };
        self.cpu.forward(&[step]).expect("forward");
        let mut times = vec![Vec::with_capacity(reps); ns.len()];
        for _ in 0..reps {
            for (i, &n) in ns.iter().enumerate() {
                let t = Instant::now();
                let step = SeqStep {
                    tokens: &prompt[at..at + n],
                    start_pos: at,
                    block_table: &table,
                    logits: n,
                    state: None,
                };
                self.cpu.forward(&[step]).expect("forward");
                times[i].push(t.elapsed().as_secs_f64());
            }
        }
        times
            .into_iter()
            .map(|mut t| {
                t.sort_by(f64::total_cmp);
                t[reps / 2]
            })
            .collect()
    }

    /// Decodes `steps` tokens for sequences `0..n` together; returns tokens per second over all of them.
    fn decode(&mut self, n: usize, steps: usize) -> f64 {
        let t = Instant::now();
        for step in 0..steps {
            let mut inputs = Vec::with_capacity(n);
            for i in 0..n {
                let s = SeqId(i as u64);
                let pos = self.kv.computed_tokens(s).expect("computed");
                let tok = ((step * 7 + i) % 40_000 + 100) as u32;
                self.kv.append_tokens(s, &[tok]).expect("append");
                self.kv.reserve(s, 1).expect("reserve");
                inputs.push((vec![tok], pos, self.kv.block_table(s).expect("table").to_vec()));
            }
            let batch: Vec<SeqStep<'_>> = inputs
                .iter()
                .map(|(t, p, b)| SeqStep { tokens: t, start_pos: *p, block_table: b, logits: 1, state: None })
                .collect();
            self.cpu.forward(&batch).expect("forward");
            for i in 0..n {
                self.kv.commit(SeqId(i as u64), 1).expect("commit");
            }
        }
        (n * steps) as f64 / t.elapsed().as_secs_f64()
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let dir = ensure_default_model(&models_dir(), &mut Silent, false).expect("default model");
    let m = ModelFiles::load(&dir).expect("load");
    let weights = Arc::new(m.weights);
    let blocks = 2048;
    let with_kv = |weights: &Arc<_>, dtype, blocks: usize| Bench {
        cpu: CpuBackend::with_kv_dtype(m.config.clone(), Arc::clone(weights), blocks, BS, dtype),
        kv: KvCache::new(KvConfig { num_blocks: blocks as u32, block_size: BS as u32 }).expect("kv"),
    };
    let fresh = |weights: &Arc<_>| with_kv(weights, KvDtype::F32, blocks);
    let steps =
        std::env::var("STEPS").ok().and_then(|v| v.parse().ok()).unwrap_or(if quick { 8 } else { 32 });
    let threads = rayon::current_num_threads();

    // The same single-sequence decode reading quantized weights.
    let quantized = |format| {
        let mut b = fresh(&weights);
        b.cpu = b.cpu.with_weight_format(format).expect("quantize");
        b.prefill(1, 16);
        b.decode(1, steps * 2)
    };
    // What `--weights q4` serves: multi-row steps read the Q4 weights through the bf16 GEMM where the
    // CPU has AVX-512 BF16.
    let q4_kv = |weights: &Arc<_>, dtype, blocks| {
        let mut b = with_kv(weights, dtype, blocks);
        b.cpu = b.cpu.with_weight_format(pdserve_model::WeightFormat::Q4).expect("quantize");
        b
    };
    let q4_backend = |weights: &Arc<_>| q4_kv(weights, KvDtype::F32, blocks);
    // ... with int8 activations (`--activations q8`).
    let q4_int8 = || {
        let mut b = q4_backend(&weights);
        b.cpu = b.cpu.with_int8_activations(true);
        b
    };
    let multi = q4_backend(&weights).cpu.multi_row_format();
    // Decode after a 4,000-token prompt: attention over the paged cache dominates there.
    let q4_long = |dtype| {
        let mut b = q4_kv(&weights, dtype, blocks);
        b.prefill(1, 4000);
        b.decode(1, steps * 2)
    };
    // 32 sequences of 1,000 tokens decoding together (an agent fleet's step): 3.5 GB of f32 KV read
    // per step.
    let q4_fleet = |dtype| {
        let mut b = q4_kv(&weights, dtype, 32 * 1100 / BS);
        b.prefill(32, 1000);
        b.decode(32, steps)
    };
    // `n` sequences of 64 tokens decoding together.
    let batch = |n: usize, q4: bool| {
        let mut b = if q4 { q4_backend(&weights) } else { fresh(&weights) };
        b.prefill(n, 64);
        b.decode(n, steps)
    };
    type Figure<'a> = (&'static str, Box<dyn Fn() -> f64 + 'a>);
    let figures: Vec<Figure<'_>> = vec![
        (
            "single_decode_tokens_per_second",
            Box::new(|| {
                let mut b = fresh(&weights);
                b.prefill(1, 16);
                b.decode(1, steps * 2)
            }),
        ),
        ("single_decode_q8_tokens_per_second", Box::new(|| quantized(pdserve_model::WeightFormat::Q8))),
        ("single_decode_q4_tokens_per_second", Box::new(|| quantized(pdserve_model::WeightFormat::Q4))),
        ("prefill_1000_tokens_per_second", Box::new(|| 1000.0 / fresh(&weights).prefill(1, 1000))),
        ("prefill_1000_q4_tokens_per_second", Box::new(|| 1000.0 / q4_backend(&weights).prefill(1, 1000))),
        // What the server computes: f16 KV, the prompt in the scheduler's 512-token chunks.
        (
            "prefill_1000_q4_f16_kv_chunked_tokens_per_second",
            Box::new(|| 1000.0 / q4_kv(&weights, KvDtype::F16, blocks).prefill_chunked(1000, 512)),
        ),
        // A long prompt as a worker prefills it (the quadratic part: attention over up to 4,000 keys).
        (
            "prefill_4000_q4_f16_kv_chunked_tokens_per_second",
            Box::new(|| 4000.0 / q4_kv(&weights, KvDtype::F16, blocks).prefill_chunked(4000, 512)),
        ),
        // A burst of short prompts in one step: 24 of 83 tokens (what 32 streams' second step holds).
        (
            "prefill_24_prompts_of_83_q4_tokens_per_second",
            Box::new(|| (24 * 83) as f64 / q4_backend(&weights).prefill_together(24, 83)),
        ),
        ("decode_q4_at_4000_tokens_per_second", Box::new(|| q4_long(KvDtype::F32))),
        ("decode_q4_at_4000_f16_kv_tokens_per_second", Box::new(|| q4_long(KvDtype::F16))),
        // What a served agent turn decodes at (`cargo xtask bench spec`'s prompts: about 400 tokens).
        (
            "decode_q4_at_500_f16_kv_tokens_per_second",
            Box::new(|| {
                let mut b = q4_kv(&weights, KvDtype::F16, blocks);
                b.prefill(1, 500);
                b.decode(1, steps * 2)
            }),
        ),
        ("batch32_decode_q4_at_1000_tokens_per_second", Box::new(|| q4_fleet(KvDtype::F32))),
        ("batch32_decode_q4_at_1000_f16_kv_tokens_per_second", Box::new(|| q4_fleet(KvDtype::F16))),
        // How much more a 256-token prefill chunk costs at position 7,500 than at the start of a
        // prompt (the scheduler's `attention_cost_positions` comes from this).
        (
            "chunk256_at_7500_vs_at_0_cost_ratio",
            Box::new(|| {
                let far = q4_kv(&weights, KvDtype::F16, blocks).chunk_at(7500, 256);
                far / q4_kv(&weights, KvDtype::F16, blocks).chunk_at(0, 256)
            }),
        ),
        // What speculative decoding's verification costs: a step of 1 + 4 and of 1 + 8 drafted tokens
        // at position 300 against a one-token step there (Q4; every row's logits).
        (
            "verify5_vs_decode_q4_cost_ratio",
            Box::new(|| {
                let reps = steps * 2;
                q4_backend(&weights).verify_at(300, 5, reps) / q4_backend(&weights).verify_at(300, 1, reps)
            }),
        ),
        (
            "verify9_vs_decode_q4_cost_ratio",
            Box::new(|| {
                let reps = steps * 2;
                q4_backend(&weights).verify_at(300, 9, reps) / q4_backend(&weights).verify_at(300, 1, reps)
            }),
        ),
        // What a row past a tile of the products costs (AVX-512: tiles of 4 rows): steps of 1 + 4
        // and 1 + 8 tokens against 1 + 3 and 1 + 7, taken in turn on one backend.
        (
            "verify5_vs_verify4_q4_cost_ratio",
            Box::new(|| {
                let t = q4_backend(&weights).verify_sizes_at(300, &[4, 5], steps * 2);
                t[1] / t[0]
            }),
        ),
        (
            "verify9_vs_verify8_q4_cost_ratio",
            Box::new(|| {
                let t = q4_backend(&weights).verify_sizes_at(300, &[8, 9], steps * 2);
                t[1] / t[0]
            }),
        ),
        // The same with int8 activations (`--activations q8`): each extra row costs integer products.
        (
            "verify5_vs_decode_q4_int8_cost_ratio",
            Box::new(|| {
                let reps = steps * 2;
                q4_int8().verify_at(300, 5, reps) / q4_int8().verify_at(300, 1, reps)
            }),
        ),
        (
            "verify9_vs_decode_q4_int8_cost_ratio",
            Box::new(|| {
                let reps = steps * 2;
                q4_int8().verify_at(300, 9, reps) / q4_int8().verify_at(300, 1, reps)
            }),
        ),
        ("batch8_decode_tokens_per_second", Box::new(|| batch(8, false))),
        ("batch32_decode_tokens_per_second", Box::new(|| batch(32, false))),
        ("batch4_decode_q4_tokens_per_second", Box::new(|| batch(4, true))),
        ("batch8_decode_q4_tokens_per_second", Box::new(|| batch(8, true))),
        ("batch16_decode_q4_tokens_per_second", Box::new(|| batch(16, true))),
        ("batch32_decode_q4_tokens_per_second", Box::new(|| batch(32, true))),
        (
            "single_decode_q4_int8_tokens_per_second",
            Box::new(|| {
                let mut b = q4_int8();
                b.prefill(1, 16);
                b.decode(1, steps * 2)
            }),
        ),
        ("prefill_1000_q4_int8_tokens_per_second", Box::new(|| 1000.0 / q4_int8().prefill(1, 1000))),
        // Warm and in 512-token chunks, as served (f16 KV): the median of 5 prompts after a first;
        // with the default f32 activations, then with int8 ones.
        (
            "prefill_1000_warm_q4_f32_tokens_per_second",
            Box::new(|| 1000.0 / q4_kv(&weights, KvDtype::F16, blocks).prefill_warm(1000, 5)),
        ),
        (
            "prefill_1000_warm_q4_int8_tokens_per_second",
            Box::new(|| {
                let mut b = q4_kv(&weights, KvDtype::F16, blocks);
                b.cpu = b.cpu.with_int8_activations(true);
                1000.0 / b.prefill_warm(1000, 5)
            }),
        ),
        (
            "batch8_decode_q4_int8_tokens_per_second",
            Box::new(|| {
                let mut b = q4_int8();
                b.prefill(8, 64);
                b.decode(8, steps)
            }),
        ),
        (
            "batch32_decode_q4_int8_tokens_per_second",
            Box::new(|| {
                let mut b = q4_int8();
                b.prefill(32, 64);
                b.decode(32, steps)
            }),
        ),
    ];
    // `--only a,b` runs the figures whose names contain a or b.
    let only: Vec<String> = std::env::args()
        .skip_while(|a| a != "--only")
        .nth(1)
        .map(|v| v.split(',').map(str::to_owned).collect())
        .unwrap_or_default();
    let results: Vec<(&str, f64)> = figures
        .iter()
        .filter(|(name, _)| only.is_empty() || only.iter().any(|o| name.contains(o.as_str())))
        .map(|(name, run)| (*name, run()))
        .collect();
    println!("threads: {threads}; q4's multi-row steps read {multi} weights");
    for (k, v) in &results {
        println!("{k:<50} {v:>10.1}");
    }
    let json: Vec<String> = results.iter().map(|(k, v)| format!("\"{k}\":{v:.2}")).collect();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/bench");
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(
        dir.join("model-forward.json"),
        format!("{{\"threads\":{threads},{}}}\n", json.join(",")),
    );
}
