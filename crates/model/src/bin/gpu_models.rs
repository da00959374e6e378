//! `pdserve-gpu-models`: the GPU backend on model shapes beyond the default model (feature `cuda`).
//!
//! ```text
//! pdserve-gpu-models arch SCRIPT      tiny random checkpoint of each architecture (written by
//!                                     crates/model/tests/fixtures/tiny_reference.py, needs python3
//!                                     with numpy): GPU greedy tokens == CPU greedy tokens
//! pdserve-gpu-models logits [STEPS]   random-weight Llama-3.2-1B shape: GPU logits vs CPU logits,
//!                                     prompt and STEPS (16) teacher-forced decode steps
//! pdserve-gpu-models speed            random-weight Llama-3-8B shape (bf16, weights made on the
//!                                     device): decode tokens/s at batch 1 and 64 against the
//!                                     bandwidth bound, a 2,048-token prefill against the measured
//!                                     tensor-core GEMM rate, KV bytes per sequence
//! ```
//! Exit status 1 when a check fails. Every figure is printed with what it is measured against.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::Instant;

use pdserve_kvcache::{KvCache, KvConfig, SeqId};
use pdserve_model::{Backend, CpuBackend, GpuBackend, ModelConfig, ModelError, SeqStep, Weights};

/// Sequences in a paged KV cache, stepped through one backend.
struct Seqs {
    kv: KvCache,
}

impl Seqs {
    fn new(num_blocks: usize, block_size: usize) -> Seqs {
        Seqs {
            kv: KvCache::new(KvConfig { num_blocks: num_blocks as u32, block_size: block_size as u32 })
                .unwrap(),
        }
    }

    /// Reserves `n` more positions of `s` (its tokens already appended) and returns its next
    /// `n` tokens, their first position and its block table.
    fn next(&mut self, s: SeqId, n: usize) -> (Vec<u32>, usize, Vec<pdserve_kvcache::BlockId>) {
        let start = self.kv.computed_tokens(s).unwrap();
        self.kv.reserve(s, n).unwrap();
        let toks = self.kv.tokens(s).unwrap()[start..start + n].to_vec();
        (toks, start, self.kv.block_table(s).unwrap().to_vec())
    }

    /// One step over `parts` = (sequence, new tokens) with the last row's logits of each; returns
    /// the backend's logits (or greedy picks through `greedy`).
    fn step<R>(
        &mut self,
        parts: &[(SeqId, usize)],
        run: impl FnOnce(&[SeqStep<'_>]) -> Result<R, ModelError>,
    ) -> R {
        let prepared: Vec<_> = parts.iter().map(|&(s, n)| self.next(s, n)).collect();
        let steps: Vec<SeqStep<'_>> = prepared
            .iter()
            .map(|(t, start, table)| SeqStep {
                tokens: t,
                start_pos: *start,
                block_table: table,
                logits: 1,
                state: None,
            })
            .collect();
        let out = run(&steps).unwrap();
        for &(s, n) in parts {
            self.kv.commit(s, n).unwrap();
        }
        out
    }
}

fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().fold(0, |b, (i, x)| if *x > v[b] { i } else { b }) as u32
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// How a greedy run picks its tokens: from the logits on the host, or on the device.
enum Picker<'a> {
    Host(&'a mut dyn Backend),
    Device(&'a mut GpuBackend),
}

impl Picker<'_> {
    fn layout(&self) -> pdserve_model::KvLayout {
        match self {
            Picker::Host(b) => b.kv_layout(),
            Picker::Device(g) => g.kv_layout(),
        }
    }

    /// Each step's pick, and its logits when picked on the host.
    fn step(&mut self, st: &[SeqStep<'_>]) -> Result<(Vec<u32>, Vec<Vec<f32>>), ModelError> {
        match self {
            Picker::Host(b) => b.forward(st).map(|l| (l.iter().map(|r| argmax(r)).collect(), l)),
            Picker::Device(g) => {
                g.forward_greedy(st).map(|p| (p.into_iter().map(|(t, _)| t).collect(), Vec::new()))
            }
        }
    }
}

/// The gap between a row's two largest logits (how near a tie its greedy pick was).
fn margin(l: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::MIN, f32::MIN);
    for &x in l {
        if x > a {
            (a, b) = (x, a);
        } else if x > b {
            b = x;
        }
    }
    a - b
}

/// A greedy run: the logits at each prompt's end and each token's top-two gap (picked on the host;
/// empty on the device), and each prompt's tokens.
struct Greedy {
    first: Vec<Vec<f32>>,
    margins: Vec<Vec<f32>>,
    tokens: Vec<Vec<u32>>,
}

/// Each prompt prefilled on its own (in two chunks), then greedy decoding of all of them together
/// until each has `steps` tokens.
fn greedy(mut p: Picker<'_>, prompts: &[Vec<u32>], steps: usize) -> Greedy {
    let layout = p.layout();
    let mut seqs = Seqs::new(layout.num_blocks, layout.block_size);
    let (mut first, mut out, mut margins) = (Vec::new(), Vec::new(), Vec::new());
    for (i, prompt) in prompts.iter().enumerate() {
        let s = SeqId(i as u64);
        seqs.kv.add_sequence(s, prompt).unwrap();
        let split = prompt.len() / 5;
        seqs.step(&[(s, split)], |st| p.step(st));
        let (ids, logits) = seqs.step(&[(s, prompt.len() - split)], |st| p.step(st));
        margins.push(logits.iter().map(|l| margin(l)).collect::<Vec<f32>>());
        first.push(logits.into_iter().next().unwrap_or_default());
        out.push(ids);
    }
    let all: Vec<SeqId> = (0..prompts.len() as u64).map(SeqId).collect();
    while out[0].len() < steps {
        for (s, o) in all.iter().zip(&out) {
            seqs.kv.append_tokens(*s, &o[o.len() - 1..]).unwrap();
        }
        let parts: Vec<(SeqId, usize)> = all.iter().map(|&s| (s, 1)).collect();
        let (ids, logits) = seqs.step(&parts, |st| p.step(st));
        for (o, t) in out.iter_mut().zip(ids) {
            o.push(t);
        }
        for (m, l) in margins.iter_mut().zip(&logits) {
            m.push(margin(l));
        }
    }
    Greedy { first, margins, tokens: out }
}

/// Logits closer than this at the CPU's pick are a near tie: bf16 weights, activations and
/// attention inputs on the GPU (the CPU keeps f32) move logits by up to ~0.06 here.
const NEAR_TIE: f32 = 0.1;

/// Whether the GPU's tokens are the CPU's, or part ways first where the CPU's top two logits were a
/// near tie; and a line saying which.
fn same_or_near_tie(cpu: &Greedy, gpu: &[u32]) -> (bool, String) {
    let want = &cpu.tokens[0];
    match want.iter().zip(gpu).position(|(a, b)| a != b) {
        None => (true, "equal".into()),
        Some(i) => {
            let m = cpu.margins[0].get(i).copied().unwrap_or(f32::MAX);
            (
                m < NEAR_TIE,
                format!("first difference at token {i}, where the CPU's top two logits are {m:.4} apart"),
            )
        }
    }
}

/// The architectures of tests/architectures.rs the GPU backend runs, and those it refuses.
fn arch(script: &Path) -> bool {
    let run = [
        ("llama", r#"{}"#),
        (
            "llama3-rope",
            r#"{"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}"#,
        ),
        ("linear-rope", r#"{"rope_scaling": {"type": "linear", "factor": 4.0}}"#),
        (
            "yarn-rope",
            r#"{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}"#,
        ),
        ("mistral", r#"{"architectures": ["MistralForCausalLM"], "model_type": "mistral"}"#),
        ("llama-bias", r#"{"attention_bias": true}"#),
        ("qwen2", r#"{"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}"#),
        (
            "qwen3",
            r#"{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 16,
            "hidden_size": 64, "sliding_window": 16, "use_sliding_window": false}"#,
        ),
    ];
    let refused = [
        (
            "mistral-window",
            r#"{"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 12}"#,
        ),
        (
            "mixtral",
            r#"{"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
            "num_experts_per_tok": 2}"#,
        ),
    ];
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % 93 + 3) as u32).collect();
    let prompts: Vec<Vec<u32>> =
        [23usize, 40, 9].iter().map(|&n| (0..n).map(|i| (i * 53 % 91 + 4) as u32).collect()).collect();
    let mut ok = true;
    for (name, config, expect_run) in
        run.iter().map(|(n, c)| (n, c, true)).chain(refused.iter().map(|(n, c)| (n, c, false)))
    {
        let dir = std::env::temp_dir().join(format!("pdserve-gpu-arch-{}-{name}", std::process::id()));
        // The GPU kernels take heads of 64 or 128 values; the script's tiny shape has 16.
        let mut config: serde_json::Value = serde_json::from_str(config).unwrap();
        config["head_dim"] = 64.into();
        let st = Command::new("python3")
            .arg(script)
            .args(["write", dir.to_str().unwrap(), &config.to_string()])
            .status()
            .expect("python3 runs");
        assert!(st.success(), "{name}: the checkpoint script failed");
        let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
        let weights = Weights::load(&dir, &cfg).unwrap();
        match GpuBackend::new(cfg.clone(), &weights, 32, 8, 0) {
            Ok(mut gpu) => {
                let mut cpu = CpuBackend::new(cfg, Arc::new(weights), 32, 8);
                let c = greedy(Picker::Host(&mut cpu), std::slice::from_ref(&prompt), 12);
                let g = greedy(Picker::Host(&mut gpu), std::slice::from_ref(&prompt), 12);
                // Three prompts decoded together (a padded batch of 4), picked on the device, against
                // each alone.
                let batched = greedy(Picker::Device(&mut gpu), &prompts, 12).tokens;
                let singles: Vec<Vec<u32>> = prompts
                    .iter()
                    .map(|p| greedy(Picker::Host(&mut gpu), std::slice::from_ref(p), 12).tokens.remove(0))
                    .collect();
                let ((same, how), same_batch) = (same_or_near_tie(&c, &g.tokens[0]), batched == singles);
                println!(
                    "{name}: GPU greedy vs CPU greedy (12 tokens): {how}; max |logit diff| at the prompt's end {:.4} (logits up to {:.3}); 3 prompts batched with device picks == one at a time: {same_batch}",
                    max_abs_diff(&c.first[0], &g.first[0]),
                    c.first[0].iter().fold(0.0f32, |m, x| m.max(x.abs()))
                );
                ok &= same && same_batch && expect_run;
            }
            Err(e) => {
                println!("{name}: refused: {e}");
                ok &= !expect_run;
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    ok
}

/// A Llama config of the given shape (random weights fill it): (hidden, layers, heads, KV heads,
/// intermediate, vocabulary), tied embeddings or not.
fn shape(
    (hidden, layers, heads, kv_heads, inter, vocab): (usize, usize, usize, usize, usize, usize),
    tied: bool,
) -> ModelConfig {
    ModelConfig::from_json(&format!(
        r#"{{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": {hidden},
        "intermediate_size": {inter}, "num_hidden_layers": {layers}, "num_attention_heads": {heads},
        "num_key_value_heads": {kv_heads}, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 131072, "vocab_size": {vocab}, "tie_word_embeddings": {tied},
        "rope_scaling": {{"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}}}"#
    ))
    .unwrap()
}

/// Host weights of `cfg`'s shape, the same seeded bf16 values the device fill would make.
fn host_random(cfg: &ModelConfig, seed: u64) -> Weights {
    use rayon::prelude::*;
    let mut next = seed;
    let mut rand = |n: usize| -> Vec<f32> {
        next = next.wrapping_add(0x632b_e59b_d9b4_e019);
        let s = next;
        (0..n as u64)
            .into_par_iter()
            .map(|i| {
                let b =
                    pdserve_kernels_sm120::reference::random_bf16(s, i, pdserve_model::RANDOM_WEIGHT_SCALE);
                pdserve_kernels_sm120::reference::bf16_to_f32(b)
            })
            .collect()
    };
    Weights::filled(cfg, false, &mut rand)
}

/// Random-weight 1B shape: the GPU's logits against the CPU's (same bf16 weights) over a prompt and
/// `steps` decode steps fed the CPU's greedy tokens. Passes when every step's largest difference is
/// within 2% of that step's largest logit.
fn logits(steps: usize) -> bool {
    let cfg = shape((2048, 16, 32, 8, 8192, 128_256), true);
    let t0 = Instant::now();
    let w = host_random(&cfg, 7);
    println!(
        "1B shape: {} layers, hidden 2048; host weights made in {:.1} s",
        cfg.num_layers,
        t0.elapsed().as_secs_f64()
    );
    let mut gpu = GpuBackend::new(cfg.clone(), &w, 64, 16, 0).unwrap();
    let mut cpu = CpuBackend::new(cfg, Arc::new(w), 64, 16);
    let prompt: Vec<u32> = (0..48u32).map(|i| i * 2_654_435 % 128_000 + 10).collect();
    let (mut a, mut b) = (Seqs::new(64, 16), Seqs::new(64, 16));
    let s = SeqId(1);
    a.kv.add_sequence(s, &prompt).unwrap();
    b.kv.add_sequence(s, &prompt).unwrap();
    let mut cl = a.step(&[(s, prompt.len())], |st| cpu.forward(st)).remove(0);
    let mut gl = b.step(&[(s, prompt.len())], |st| gpu.forward(st)).remove(0);
    let (mut ok, mut agree, mut worst) = (true, 0, 0.0f32);
    for i in 0..=steps {
        let d = max_abs_diff(&cl, &gl);
        let top = cl.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let rel = d / top;
        worst = worst.max(rel);
        ok &= rel <= 0.02;
        agree += usize::from(argmax(&cl) == argmax(&gl));
        println!(
            "  {} : max |logit diff| {d:.4}, largest |logit| {top:.3} ({:.2}%), argmax equal {}",
            if i == 0 { "prompt".to_string() } else { format!("step {i:2}") },
            rel * 100.0,
            argmax(&cl) == argmax(&gl)
        );
        if i == steps {
            break;
        }
        let t = argmax(&cl);
        a.kv.append_tokens(s, &[t]).unwrap();
        b.kv.append_tokens(s, &[t]).unwrap();
        cl = a.step(&[(s, 1)], |st| cpu.forward(st)).remove(0);
        gl = b.step(&[(s, 1)], |st| gpu.forward(st)).remove(0);
    }
    println!(
        "1B shape: worst step {:.2}% of the largest logit (limit 2%); argmax equal {agree}/{}",
        worst * 100.0,
        steps + 1
    );
    ok
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Random-weight Llama-3-8B shape on the device: the issue's throughput figures.
fn speed() -> bool {
    let big = shape((4096, 32, 32, 8, 14336, 128_256), false);
    let small = shape((576, 30, 9, 3, 1536, 49_152), true);
    speed_of("Llama-3-8B shape", big) && speed_of("SmolLM2-135M shape", small)
}

/// Decode tokens/s at batch 1 and 64 against the bandwidth bound, a 2,048-token prefill against the
/// measured GEMM rate, KV bytes per sequence, for a random-weight model of `cfg`'s shape.
fn speed_of(label: &str, cfg: ModelConfig) -> bool {
    let (bs, blocks) = (16usize, 6144usize);
    let t0 = Instant::now();
    let mut gpu = match GpuBackend::random(cfg.clone(), 11, blocks, bs, 0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("error: {e}");
            return false;
        }
    };
    let g = gpu.gpu();
    println!("device: {} ({}, {} SMs)", g.name(), g.arch(), g.num_sms());
    let weights = gpu.weight_bytes();
    println!(
        "{label}: {:.2} GB of bf16 weights made on the device in {:.1} s",
        weights as f64 / 1e9,
        t0.elapsed().as_secs_f64()
    );
    let (copy, gemm) = peaks(gpu.gpu());
    println!("copy bandwidth (1 GiB device copy, read + write): {:.0} GB/s; bf16 GEMM 8192^3 via cuBLAS: {:.0} TFLOP/s", copy / 1e9, gemm / 1e12);
    products(gpu.gpu(), &cfg, copy, gemm);
    let kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2;
    let h = cfg.hidden_size;
    // Bytes one decode step reads: every matrix except the embedding (one row of it), the LM head.
    let step_bytes =
        |ctx: usize, batch: usize| (weights - cfg.vocab_size * h * 2 + batch * ctx * kv_per_token) as f64;
    let mut seqs = Seqs::new(blocks, bs);
    let (mut next_id, vocab) = (0u64, cfg.vocab_size as u64);
    let mut new_seq = |seqs: &mut Seqs, len: usize| {
        next_id += 1;
        let toks: Vec<u32> =
            (0..len as u64).map(|i| ((next_id * 7919 + i * 104_729) % vocab) as u32).collect();
        seqs.kv.add_sequence(SeqId(next_id), &toks).unwrap();
        SeqId(next_id)
    };
    // Decode: prefill `batch` prompts of `ctx` tokens, then time `n` greedy steps (only ids back),
    // then `n` more steps that bring every row's logits to the host.
    let mut decode = |gpu: &mut GpuBackend,
                      seqs: &mut Seqs,
                      batch: usize,
                      ctx: usize,
                      n: usize|
     -> [f64; 4] {
        let ids: Vec<SeqId> = (0..batch).map(|_| new_seq(seqs, ctx)).collect();
        for chunk in ids.chunks((4096 / ctx).max(1)) {
            let parts: Vec<(SeqId, usize)> = chunk.iter().map(|&s| (s, ctx)).collect();
            seqs.step(&parts, |st| gpu.forward_greedy(st));
        }
        let mut last: Vec<u32> = vec![1; batch];
        // `n / 2` steps picking on the device or on the host, with or without CUDA graphs, with
        // the skinny product or cuBLAS for the step's products.
        let mut timed =
            |(greedy, graphs, skinny): (bool, bool, bool), gpu: &mut GpuBackend, seqs: &mut Seqs| {
                gpu.set_cuda_graphs(graphs);
                gpu.set_skinny_products(skinny);
                gpu.take_step_times();
                let t = Instant::now();
                for _ in 0..n / 2 {
                    for (s, tok) in ids.iter().zip(&last) {
                        seqs.kv.append_tokens(*s, &[*tok]).unwrap();
                    }
                    let parts: Vec<(SeqId, usize)> = ids.iter().map(|&s| (s, 1)).collect();
                    last = if greedy {
                        seqs.step(&parts, |st| gpu.forward_greedy(st)).into_iter().map(|(t, _)| t).collect()
                    } else {
                        seqs.step(&parts, |st| gpu.forward(st)).iter().map(|l| argmax(l)).collect()
                    };
                }
                (t.elapsed().as_secs_f64(), gpu.take_step_times())
            };
        // As served (graphs, skinny products), with cuBLAS instead, without graphs: alternating
        // (A B C A B C); then with the logits to the host.
        let modes = [(true, true, true), (true, true, false), (true, false, true)];
        let mut secs = [0.0; 3];
        let mut served = pdserve_model::StepTimes::default();
        for _ in 0..2 {
            for (i, (m, s)) in modes.iter().zip(secs.iter_mut()).enumerate() {
                let (t, phases) = timed(*m, gpu, seqs);
                *s += t;
                if i == 0 {
                    served.steps += phases.steps;
                    served.prepare_s += phases.prepare_s;
                    served.launch_s += phases.launch_s;
                    served.finish_s += phases.finish_s;
                }
            }
        }
        let per = |x: f64| x / served.steps.max(1) as f64 * 1e6;
        println!(
                "  batch {batch}, context {ctx}, as served, per step: describe and copy in {:.0} us, queue launches {:.0} us, wait and copy back {:.0} us",
                per(served.prepare_s),
                per(served.launch_s),
                per(served.finish_s)
            );
        let (logits_s, _) = timed((false, true, true), gpu, seqs);
        for s in ids {
            seqs.kv.free_sequence(s, false).unwrap();
        }
        let tokens = (batch * (n / 2)) as f64;
        [2.0 * tokens / secs[0], 2.0 * tokens / secs[1], 2.0 * tokens / secs[2], tokens / logits_s]
    };
    for (batch, ctx, n) in [(1usize, 512usize, 128usize), (1, 4096, 64), (64, 512, 32)] {
        let [ids_tps, cublas_tps, eager_tps, logits_tps] = decode(&mut gpu, &mut seqs, batch, ctx, n);
        let bound = copy / step_bytes(ctx + n, batch) * batch as f64;
        let hbm = 4.8e12 / step_bytes(ctx + n, batch) * batch as f64;
        println!(
            "{label}: decode batch {batch:2}, context {ctx}: {ids_tps:8.1} tok/s (ids only) = {:.2} of the copy-bandwidth bound ({bound:.0} tok/s), {:.2} of the 4.8 TB/s datasheet bound; cuBLAS for every product {cublas_tps:.1}; without CUDA graphs {eager_tps:.1}; with every row's logits to the host {logits_tps:.1}",
            ids_tps / bound,
            ids_tps / hbm
        );
    }
    let (captures, replays) = gpu.cuda_graph_stats();
    println!("{label}: CUDA graphs captured {captures}, steps replayed from one {replays}");
    // Prefill of 2,048 tokens: median of 5 fresh prompts.
    let len = 2048usize;
    let mut times = Vec::new();
    for _ in 0..6 {
        let s = new_seq(&mut seqs, len);
        let t = Instant::now();
        seqs.step(&[(s, len)], |st| gpu.forward_greedy(st));
        times.push(t.elapsed().as_secs_f64());
        seqs.kv.free_sequence(s, false).unwrap();
    }
    times.remove(0); // the first allocates the step buffers
    let secs = median(times);
    let (q, kv) = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
    let matmul = (cfg.num_layers * h * (2 * q + 2 * kv + 3 * cfg.intermediate_size)) as f64; // per token
    let attn = 2.0 * (len * len) as f64 * (cfg.num_heads * cfg.head_dim) as f64 * cfg.num_layers as f64;
    let flops = 2.0 * matmul * len as f64 + attn + 2.0 * (cfg.vocab_size * h) as f64;
    println!(
        "{label}: prefill {len} tokens: {:.1} ms, {:.0} TFLOP/s = {:.2} of the measured GEMM rate, {:.2} of 989 TFLOP/s (datasheet dense bf16)",
        secs * 1e3,
        flops / secs / 1e12,
        flops / secs / gemm,
        flops / secs / 989e12
    );
    let (free, total) = gpu.gpu().context().mem_get_info().unwrap_or((0, 0));
    println!(
        "KV per token {} KiB (bf16); an 8,192-token sequence {:.2} GiB; device memory {:.1} GiB, {:.1} GiB free with this run's {} KV blocks",
        kv_per_token / 1024,
        (kv_per_token * 8192) as f64 / (1u64 << 30) as f64,
        total as f64 / (1u64 << 30) as f64,
        free as f64 / (1u64 << 30) as f64,
        blocks
    );
    true
}

/// The layer's products (QKV, output, gate/up, down) and the LM head, each timed alone on random
/// data at a decode step's rows (1, 64) and a prefill's (2,048), through cuBLAS and, for short steps,
/// the skinny product: bandwidth against the copy rate, arithmetic against the GEMM rate, and the
/// sum over the layers (what a step's products cost without anything between them).
fn products(g: &pdserve_kernels_sm120::Gpu, cfg: &ModelConfig, copy: f64, gemm: f64) {
    let (h, q, kv, inter) = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    );
    let shapes = [
        ("qkv", h, q + 2 * kv),
        ("o", q, h),
        ("gate_up", h, 2 * inter),
        ("down", inter, h),
        ("lm_head", h, cfg.vocab_size),
    ];
    for t in [1usize, 8, 64, 2048] {
        let mut line = format!("  products at {t} rows:");
        let (mut layer_cublas, mut layer_skinny) = (0.0, 0.0);
        for (name, k, n) in shapes {
            let mut x = g.zeros::<u16>(t * k).unwrap();
            let mut w = g.zeros::<u16>(n * k).unwrap();
            g.fill_random_bf16(&mut x.as_view_mut(), 3, 1.0).unwrap();
            g.fill_random_bf16(&mut w.as_view_mut(), 4, 0.05).unwrap();
            let mut y = g.zeros::<f32>(t * n).unwrap();
            let mut time = |skinny: bool| {
                median(
                    (0..5)
                        .map(|_| {
                            g.time_ms(10, || {
                                let (xv, wv, yv) = (&x.as_view(), &w.as_view(), &mut y.as_view_mut());
                                if skinny {
                                    g.gemv_bf16(xv, wv, yv, t, k, n)
                                } else {
                                    g.gemm_bf16_cublas(xv, wv, yv, t, k, n)
                                }
                            })
                            .unwrap() as f64
                        })
                        .collect(),
                )
            };
            let cublas = time(false);
            let bytes = ((n * k + t * k) * 2 + t * n * 4) as f64;
            let flops = 2.0 * (t * n * k) as f64;
            line += &format!(
                " {name} cuBLAS {:.3} ms ({:.2} of copy, {:.2} of GEMM)",
                cublas,
                bytes / (cublas * 1e-3) / copy,
                flops / (cublas * 1e-3) / gemm
            );
            let skinny = if t <= pdserve_kernels_sm120::launch::GEMV_MAX_ROWS {
                let s = time(true);
                line += &format!(" skinny {:.3} ms ({:.2} of copy)", s, bytes / (s * 1e-3) / copy);
                s
            } else {
                cublas
            };
            if name != "lm_head" {
                layer_cublas += cublas;
                layer_skinny += skinny;
            }
            line += ";";
        }
        println!("{line}");
        println!(
            "  products at {t} rows, all {} layers: cuBLAS {:.2} ms, as served {:.2} ms",
            cfg.num_layers,
            layer_cublas * cfg.num_layers as f64,
            layer_skinny * cfg.num_layers as f64
        );
    }
}

/// Copy bandwidth (bytes read + written per second) and the bf16 GEMM rate (FLOP/s) of cuBLAS at
/// 8192^3, each the median of 5 timings of 10 calls.
fn peaks(g: &pdserve_kernels_sm120::Gpu) -> (f64, f64) {
    let n = 512usize << 20;
    let a = g.zeros::<u16>(n).unwrap();
    let mut b = g.zeros::<u16>(n).unwrap();
    let copy_ms = median(
        (0..5)
            .map(|_| g.time_ms(10, || g.copy(&a.as_view(), &mut b.as_view_mut())).unwrap() as f64)
            .collect(),
    );
    let m = 8192usize;
    let mut x = g.zeros::<u16>(m * m).unwrap();
    let mut w = g.zeros::<u16>(m * m).unwrap();
    g.fill_random_bf16(&mut x.as_view_mut(), 1, 1.0).unwrap();
    g.fill_random_bf16(&mut w.as_view_mut(), 2, 1.0).unwrap();
    let mut y = g.zeros::<f32>(m * m).unwrap();
    let gemm_ms = median(
        (0..5)
            .map(|_| {
                g.time_ms(10, || g.gemm_bf16(&x.as_view(), &w.as_view(), &mut y.as_view_mut(), m, m, m))
                    .unwrap() as f64
            })
            .collect(),
    );
    (4.0 * n as f64 / (copy_ms * 1e-3), 2.0 * (m * m * m) as f64 / (gemm_ms * 1e-3))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let ok = match args.first().map(String::as_str) {
        Some("arch") if args.len() == 2 => arch(&PathBuf::from(&args[1])),
        Some("logits") => logits(args.get(1).and_then(|s| s.parse().ok()).unwrap_or(16)),
        Some("speed") => speed(),
        _ => {
            eprintln!("usage: pdserve-gpu-models arch SCRIPT | logits [STEPS] | speed");
            return ExitCode::from(2);
        }
    };
    println!("{}", if ok { "PASS" } else { "FAIL" });
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
