//! The default model (SmolLM2-135M-Instruct), fetched and imported on first use, checked against an
//! independent reference (tests/fixtures/reference.json, made by tests/fixtures/make_reference.py).

use std::sync::{Arc, Mutex, OnceLock};

use pdserve_import::fetch::{ensure_default_model, models_dir};
use pdserve_import::{permute_qk, Silent};
use pdserve_kvcache::{KvCache, KvConfig, SeqId};
use pdserve_model::{
    Backend, ChatMessage, CpuBackend, IncrementalDecoder, ModelConfig, ModelFiles, Sampler, SamplingParams,
    SeqStep, TextCodec, Weights,
};

struct Loaded {
    config: ModelConfig,
    weights: Arc<Weights>,
    text: TextCodec,
}

fn model() -> &'static Loaded {
    static MODEL: OnceLock<Loaded> = OnceLock::new();
    MODEL.get_or_init(|| {
        let dir = ensure_default_model(&models_dir(), &mut Silent, false).expect("default model");
        let m = ModelFiles::load(&dir).expect("load");
        Loaded { config: m.config, weights: Arc::new(m.weights), text: m.text }
    })
}

/// Tests share one backend (its KV memory is large); they take turns.
fn backend() -> std::sync::MutexGuard<'static, CpuBackend> {
    static CPU: OnceLock<Mutex<CpuBackend>> = OnceLock::new();
    let m = model();
    CPU.get_or_init(|| Mutex::new(CpuBackend::new(m.config.clone(), Arc::clone(&m.weights), 64, 16)))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// A sequence driven through a KV cache and a backend: prefill in the given chunks, then greedy decode.
struct Run<'a> {
    kv: KvCache,
    cpu: &'a mut CpuBackend,
    seq: SeqId,
}

impl<'a> Run<'a> {
    fn new(cpu: &'a mut CpuBackend, tokens: &[u32]) -> Self {
        let layout = cpu.kv_layout();
        let mut kv = KvCache::new(KvConfig {
            num_blocks: layout.num_blocks as u32,
            block_size: layout.block_size as u32,
        })
        .unwrap();
        kv.add_sequence(SeqId(1), tokens).unwrap();
        Run { kv, cpu, seq: SeqId(1) }
    }

    /// Runs the next `n` known tokens; returns the logits of the last.
    fn step(&mut self, n: usize) -> Vec<f32> {
        let start = self.kv.computed_tokens(self.seq).unwrap();
        self.kv.reserve(self.seq, n).unwrap();
        let tokens = self.kv.tokens(self.seq).unwrap()[start..start + n].to_vec();
        let table = self.kv.block_table(self.seq).unwrap().to_vec();
        let out = self
            .cpu
            .forward(&[SeqStep {
                tokens: &tokens,
                start_pos: start,
                block_table: &table,
                logits: 1,
                state: None,
            }])
            .unwrap();
        self.kv.commit(self.seq, n).unwrap();
        out.into_iter().next().unwrap()
    }

    fn greedy(&mut self, first_logits: Vec<f32>, n: usize) -> Vec<u32> {
        let mut out = Vec::new();
        let mut logits = first_logits;
        let mut s = Sampler::new(SamplingParams::greedy(), 0);
        while out.len() < n {
            let t = s.sample(&logits, &[], &out).token;
            out.push(t);
            if out.len() == n {
                break;
            }
            self.kv.append_tokens(self.seq, &[t]).unwrap();
            logits = self.step(1);
        }
        out
    }
}

fn fixture() -> serde_json::Value {
    serde_json::from_str(include_str!("fixtures/reference.json")).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Largest |ours - reference| over the fixture's logits at `pos` (its top 10 and probe ids).
fn max_logit_error(ours: &[f32], reference: &serde_json::Value) -> f32 {
    let pairs = reference["top"].as_array().unwrap().iter().chain(reference["probe"].as_array().unwrap());
    pairs
        .map(|p| {
            let (id, want) = (p[0].as_u64().unwrap() as usize, p[1].as_f64().unwrap() as f32);
            (ours[id] - want).abs()
        })
        .fold(0.0, f32::max)
}

/// Logits within this absolute error of the reference (logits here range over about ±30; the error
/// measured when the fixture was made was 8.4e-5).
const LOGIT_TOLERANCE: f32 = 1e-3;

/// Checks every fixture prompt on `cpu`: logits at the fixture's positions and 32 greedy tokens.
/// Returns the worst logit error and whether all greedy tokens matched.
fn check_against_reference(cpu: &mut CpuBackend) -> (f32, bool) {
    let fx = fixture();
    let mut worst = 0.0f32;
    let mut greedy_ok = true;
    for p in fx["prompts"].as_array().unwrap() {
        let tokens = ids(&p["ids"]);
        let mut run = Run::new(cpu, &tokens);
        // Prefill in chunks ending at each checked position, so each chunk's last logits are checked.
        let mut done = 0;
        let mut last = Vec::new();
        for pos in p["positions"].as_array().unwrap() {
            let at = pos["pos"].as_u64().unwrap() as usize;
            last = run.step(at + 1 - done);
            done = at + 1;
            worst = worst.max(max_logit_error(&last, pos));
        }
        let want = ids(&p["greedy"]);
        let got = run.greedy(last, want.len());
        greedy_ok &= got == want;
    }
    (worst, greedy_ok)
}

#[test]
fn matches_the_independent_reference() {
    let mut cpu = backend();
    let (worst, greedy_ok) = check_against_reference(&mut cpu);
    assert!(worst < LOGIT_TOLERANCE, "max logit error {worst} over {LOGIT_TOLERANCE}");
    assert!(greedy_ok, "greedy tokens differ from the reference");
}

#[test]
fn gguf_ordered_qk_with_rotate_half_rope_is_caught() {
    let m = model();
    let mut w = (*m.weights).clone();
    let (nh, nkv, h) = (m.config.num_heads, m.config.num_kv_heads, m.config.hidden_size);
    for l in &mut w.layers {
        l.q = permute_qk(&l.q, nh, h);
        l.k = permute_qk(&l.k, nkv, h);
    }
    let mut cpu = CpuBackend::new(m.config.clone(), Arc::new(w), 64, 16);
    let (worst, greedy_ok) = check_against_reference(&mut cpu);
    assert!(worst > 10.0 * LOGIT_TOLERANCE && !greedy_ok, "the mixed-convention model passed ({worst})");
    // And the symptom target.md describes: asked a question, it ends its answer at once.
    let prompt = m
        .text
        .apply_chat_template(&[ChatMessage::new("user", "What is the capital of France?")], true)
        .unwrap();
    let tokens = m.text.encode(&prompt).unwrap();
    let mut run = Run::new(&mut cpu, &tokens);
    let logits = run.step(tokens.len());
    assert_eq!(run.greedy(logits, 1), [2], "expected <|im_end|> at once");
}

#[test]
fn answers_the_capital_of_france() {
    let m = model();
    let prompt = m
        .text
        .apply_chat_template(&[ChatMessage::new("user", "What is the capital of France?")], true)
        .unwrap();
    let tokens = m.text.encode(&prompt).unwrap();
    let mut cpu = backend();
    let mut run = Run::new(&mut cpu, &tokens);
    let logits = run.step(tokens.len());
    let out = run.greedy(logits, 12);
    let end = out.iter().position(|&t| t == 2).expect("an <|im_end|>");
    let mut detok = IncrementalDecoder::new();
    let mut text = String::new();
    for &t in &out[..end] {
        text.push_str(&detok.push(&m.text, t).unwrap());
    }
    text.push_str(&detok.finish(&m.text).unwrap());
    assert_eq!(text, "The capital of France is Paris.");
}

#[test]
fn chunked_token_by_token_and_batched_prefill_agree() {
    let m = model();
    let fx = fixture();
    let long = ids(&fx["prompts"][2]["ids"]);
    let mut cpu = backend();
    let whole = Run::new(&mut cpu, &long).step(long.len());
    let mut run = Run::new(&mut cpu, &long);
    for n in [5, 16, 1, 30] {
        run.step(n);
    }
    let chunked = run.step(long.len() - 52);
    let mut run = Run::new(&mut cpu, &long);
    let mut by_token = Vec::new();
    for _ in 0..long.len() {
        by_token = run.step(1);
    }
    let diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
    assert!(diff(&whole, &chunked) < 1e-3, "chunked differs by {}", diff(&whole, &chunked));
    assert!(diff(&whole, &by_token) < 1e-3, "token by token differs by {}", diff(&whole, &by_token));

    // Three different sequences in one step give what each gives alone.
    let prompts: Vec<Vec<u32>> = fx["prompts"].as_array().unwrap().iter().map(|p| ids(&p["ids"])).collect();
    let alone: Vec<Vec<f32>> = prompts.iter().map(|p| Run::new(&mut cpu, p).step(p.len())).collect();
    let mut kv = KvCache::new(KvConfig { num_blocks: 64, block_size: 16 }).unwrap();
    let mut tables = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        kv.add_sequence(SeqId(i as u64), p).unwrap();
        kv.reserve(SeqId(i as u64), p.len()).unwrap();
        tables.push(kv.block_table(SeqId(i as u64)).unwrap().to_vec());
    }
    let steps: Vec<SeqStep<'_>> = prompts
        .iter()
        .zip(&tables)
        .map(|(p, t)| SeqStep { tokens: p, start_pos: 0, block_table: t, logits: 1, state: None })
        .collect();
    let batched = cpu.forward(&steps).unwrap();
    for (a, b) in alone.iter().zip(&batched) {
        assert!(diff(a, b) < 1e-3, "batched differs by {}", diff(a, b));
    }
    assert_eq!(m.config.vocab_size, batched[0].len());
}

#[test]
fn tokenizer_vectors() {
    let t = &model().text;
    assert_eq!(t.encode("Hello, world! How are you?").unwrap(), [19556, 28, 905, 17, 1073, 359, 346, 47]);
    let digits = t.encode("2024").unwrap();
    assert_eq!(digits.len(), 4, "digits are split singly: {digits:?}");
    assert_eq!(t.encode("<|im_start|>user").unwrap()[0], 1, "special tokens in text become their ids");
    for s in [
        "  leading and   inner   spaces\n\n\ttabs ",
        "東京は日本の首都です。",
        "emoji 🦀🚀 and 👩‍👩‍👧",
        "mixed 123 числа",
    ] {
        let ids = t.encode(s).unwrap();
        assert_eq!(t.decode(&ids, false).unwrap(), s, "round trip of {s:?}");
        // Streaming never emits half a character, and the pieces add up to the text.
        let mut d = IncrementalDecoder::new();
        let mut streamed = String::new();
        for &id in &ids {
            let piece = d.push(t, id).unwrap();
            assert!(!piece.contains('\u{FFFD}'), "broken character streamed for {s:?}");
            streamed.push_str(&piece);
        }
        streamed.push_str(&d.finish(t).unwrap());
        assert_eq!(streamed, s);
    }
}

#[test]
fn chat_template_renders_like_hugging_face() {
    let t = &model().text;
    let msgs = [ChatMessage::new("user", "Hi")];
    assert_eq!(
        t.apply_chat_template(&msgs, true).unwrap(),
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let msgs = [ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi")];
    assert_eq!(
        t.apply_chat_template(&msgs, false).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    );
}

/// 16-bit KV (f16, the server's default, and bf16): the fixture's logits stay close to the
/// independent reference and its 32 greedy tokens are unchanged, with f32 weights and with Q4 decode.
#[test]
fn sixteen_bit_kv_keeps_the_greedy_text() {
    let m = model();
    for (dtype, tolerance) in [(pdserve_model::KvDtype::F16, 0.03), (pdserve_model::KvDtype::Bf16, 0.2)] {
        for format in [pdserve_model::WeightFormat::F32, pdserve_model::WeightFormat::Q4] {
            let mut cpu = CpuBackend::with_kv_dtype(m.config.clone(), Arc::clone(&m.weights), 64, 16, dtype)
                .with_weight_format(format)
                .unwrap();
            let (worst, greedy_ok) = check_against_reference(&mut cpu);
            eprintln!("{dtype:?} KV, {format:?} weights: largest logit error {worst}");
            assert!(greedy_ok, "greedy tokens differ from the reference with {dtype:?} KV and {format:?}");
            if format == pdserve_model::WeightFormat::F32 {
                assert!(worst < tolerance, "{dtype:?} KV: logit error {worst}");
            }
        }
    }
}

/// Quantized weights (Q8, Q4): a decode step's logits stay within `QUANT_LOGIT_TOLERANCE` of the
/// f32 path (twice that for Q8); Q4 (exact for the default model) keeps the fixture's 32 greedy tokens, Q8 keeps them up
/// to a near-tie of f32's.
#[test]
fn quantized_decode_keeps_the_greedy_text_and_logits_close() {
    let fx = fixture();
    for format in [pdserve_model::WeightFormat::Q8, pdserve_model::WeightFormat::Q4] {
        let mut qb = quantized_backend(format);
        assert_eq!(qb.weight_format(), format);
        let mut worst = 0.0f32;
        for p in fx["prompts"].as_array().unwrap() {
            let tokens = ids(&p["ids"]);
            let want = ids(&p["greedy"]);
            let decode_step = |cpu: &mut CpuBackend| decode_step_logits(cpu, &tokens, want[0]);
            let f32_step = decode_step(&mut backend());
            let q_step = decode_step(&mut qb);
            worst = worst.max(largest_difference(&q_step, &f32_step));
            let mut run = Run::new(&mut qb, &tokens);
            let logits = run.step(tokens.len());
            let got = run.greedy(logits, want.len());
            if format == pdserve_model::WeightFormat::Q4 {
                // The default model ships Q4_1: its Q4 weights are its own values, exactly.
                assert_eq!(got, want, "greedy tokens of {:?} with {format:?}", p["name"]);
            } else if let Some(d) = got.iter().zip(&want).position(|(a, b)| a != b) {
                // Q8 re-quantizes those values (every step reads them, prefill too): the text may part
                // from f32's only where f32's two best tokens were nearly tied.
                let margin = f32_top2_margin(&[&tokens[..], &want[..d]].concat());
                eprintln!(
                    "{format:?}: {:?} parts from f32 at token {d}, f32's top-2 margin {margin}",
                    p["name"]
                );
                assert!(
                    margin < QUANT_LOGIT_TOLERANCE,
                    "{:?} parts at token {d} (margin {margin})",
                    p["name"]
                );
            }
        }
        eprintln!("{format:?}: largest |logit - f32 logit| over a decode step of each prompt: {worst}");
        // Q8 of this model quantizes its Q4_1 values a second time, in prefill as in decode (measured
        // 0.71 over the three prompts); Q4 gives them back exactly, so only bf16 rounding is left.
        let tolerance =
            if format == pdserve_model::WeightFormat::Q8 { 2.0 } else { 1.0 } * QUANT_LOGIT_TOLERANCE;
        assert!(worst < tolerance, "{format:?} logits differ from f32 by {worst}");
    }
}

/// Int8 activations (`--activations q8`) with Q4 and Q8 weights: a prompt's step and a decode step's
/// logits stay within `INT8_LOGIT_TOLERANCE` of the f32 path (under `PDSERVE_CPU_KERNELS=avx2`, the
/// prompts of more than 16 tokens take the long steps' int8 GEMM, which `cargo xtask test` runs
/// too), and the greedy text parts from the fixture's only where
/// f32's two best tokens were within `INT8_LOGIT_TOLERANCE / 3` (rounding every input of every
/// product to 8 bits moves logits far more than quantized weights alone: see the test's output).
#[test]
fn int8_activations_keep_decode_logits_close() {
    let fx = fixture();
    for format in [pdserve_model::WeightFormat::Q4, pdserve_model::WeightFormat::Q8] {
        let mut qb = quantized_backend(format).with_int8_activations(true);
        assert!(qb.int8_activations());
        let mut worst = 0.0f32;
        for p in fx["prompts"].as_array().unwrap() {
            let tokens = ids(&p["ids"]);
            let want = ids(&p["greedy"]);
            let decode_step = |cpu: &mut CpuBackend| decode_step_logits(cpu, &tokens, want[0]);
            let f32_step = decode_step(&mut backend());
            let q_step = decode_step(&mut qb);
            // The prompt's own step: beyond 16 rows, the long steps' int8 GEMM (Q4 weights) where
            // AVX2 is the widest kernel family running, else the f32 products.
            let prefill = |cpu: &mut CpuBackend| Run::new(cpu, &tokens).step(tokens.len());
            let q_prefill = prefill(&mut qb);
            worst = worst.max(largest_difference(&q_prefill, &prefill(&mut backend())));
            let int8_gemm = format == pdserve_model::WeightFormat::Q4
                && pdserve_model::cpu_kernels() == pdserve_model::CpuKernels::Avx2
                && tokens.len() > 16;
            if int8_gemm {
                let moved = largest_difference(&q_prefill, &prefill(&mut quantized_backend(format)));
                assert!(moved > 1e-3, "the long step's int8 GEMM ran ({moved})");
            }
            // The int8 path runs: its logits are not the f32-activation Q4/Q8 path's.
            let mut plain = quantized_backend(format);
            let plain_step = decode_step(&mut plain);
            let moved = largest_difference(&q_step, &plain_step);
            assert!(moved > 1e-3, "int8 x {format:?}: logits identical to f32 activations' ({moved})");
            worst = worst.max(largest_difference(&q_step, &f32_step));
            let mut run = Run::new(&mut qb, &tokens);
            let logits = run.step(tokens.len());
            let got = run.greedy(logits, want.len());
            if let Some(d) = got.iter().zip(&want).position(|(a, b)| a != b) {
                let margin = f32_top2_margin(&[&tokens[..], &want[..d]].concat());
                eprintln!(
                    "int8 x {format:?}: {:?} parts at token {d}, f32's top-2 margin {margin}",
                    p["name"]
                );
                let near = INT8_LOGIT_TOLERANCE / 3.0;
                assert!(margin < near, "{:?} parts at token {d} (margin {margin})", p["name"]);
            }
        }
        eprintln!(
            "int8 x {format:?}: largest |logit - f32 logit| over a prompt's and a decode step: {worst}"
        );
        assert!(worst < INT8_LOGIT_TOLERANCE, "int8 x {format:?}: logits differ from f32 by {worst}");
    }
}

/// Loading for Q4 converts each layer as it is read (every step of every kernel family reads Q4, so no
/// f32 projection is left, on AVX-512 BF16 as on AVX2 alone), and the backend made from it computes
/// exactly what converting the whole f32 model gives.
#[test]
fn loading_for_q4_converts_layer_by_layer_to_the_same_backend() {
    let m = model();
    let dir = ensure_default_model(&models_dir(), &mut Silent, false).unwrap();
    let files = ModelFiles::load_for(&dir, pdserve_model::WeightFormat::Q4).unwrap();
    assert!(files.weights.layers.iter().all(|l| l.q.is_empty() && l.down.is_empty()), "f32 projections left");
    let prepared = files.prepared.unwrap();
    assert_eq!(prepared.format(), pdserve_model::WeightFormat::Q4);
    let mut streamed = CpuBackend::new(files.config.clone(), Arc::new(files.weights), 64, 16)
        .with_prepared(prepared)
        .unwrap();
    let mut whole = CpuBackend::new(m.config.clone(), Arc::new((*m.weights).clone()), 64, 16)
        .with_weight_format(pdserve_model::WeightFormat::Q4)
        .unwrap();
    assert_eq!(streamed.weight_bytes(), whole.weight_bytes());
    let tokens = ids(&fixture()["prompts"][0]["ids"]);
    let (a, b) = (
        Run::new(&mut streamed, &tokens).step(tokens.len()),
        Run::new(&mut whole, &tokens).step(tokens.len()),
    );
    assert_eq!(a, b, "the same logits, to the bit");
}

/// A backend over the shared model's weights reading them as `format` (64 blocks of 16 tokens).
fn quantized_backend(format: pdserve_model::WeightFormat) -> CpuBackend {
    let m = model();
    CpuBackend::new(m.config.clone(), Arc::clone(&m.weights), 64, 16).with_weight_format(format).unwrap()
}

/// The logits of a decode step of `next` after prefilling `tokens`.
fn decode_step_logits(cpu: &mut CpuBackend, tokens: &[u32], next: u32) -> Vec<f32> {
    let mut run = Run::new(cpu, tokens);
    run.step(tokens.len());
    run.kv.append_tokens(run.seq, &[next]).unwrap();
    run.step(1)
}

/// The largest |a[i] - b[i]|.
fn largest_difference(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max)
}

/// The gap between the f32 path's two largest logits after `tokens`.
fn f32_top2_margin(tokens: &[u32]) -> f32 {
    let mut b = backend();
    let mut logits = Run::new(&mut b, tokens).step(tokens.len());
    logits.sort_by(|a, b| b.total_cmp(a));
    logits[0] - logits[1]
}

/// Logits of a decode step with quantized weights against f32 (they range over about ±30).
const QUANT_LOGIT_TOLERANCE: f32 = 0.5;

/// ... with int8 activations too (measured over the three kernel families: Q4 1.5-2.0, Q8 0.95-1.02).
/// The long steps' int8 GEMM (AVX2, Q4) gives 2.12 on the 37-token prompt's own step, but that
/// figure is one draw: changes that move only the last bits of its sums (the order in which a
/// tile's eight lanes are added, or input groups refined by up to 5 halvings instead of 4) moved it
/// to 4.1-5.0 (2026-12-04), so a change there that fails this test may have changed its luck, not
/// its precision; the error comes from the blocks that hold an outlier channel.
const INT8_LOGIT_TOLERANCE: f32 = 3.0;

/// With quantized weights, steps of more than two rows (a batch's prefill, three sequences decoding
/// together) run the multi-row path (the Q4 matrices widened to bf16 block by block for a bf16 GEMM,
/// where the CPU has AVX-512 BF16): the three fixture
/// prompts prefilled in one step and then decoded greedily together give each prompt's fixture tokens.
#[test]
fn quantized_batched_prefill_and_decode_keep_the_greedy_text() {
    let m = model();
    let fx = fixture();
    let prompts: Vec<Vec<u32>> = fx["prompts"].as_array().unwrap().iter().map(|p| ids(&p["ids"])).collect();
    let wants: Vec<Vec<u32>> = fx["prompts"].as_array().unwrap().iter().map(|p| ids(&p["greedy"])).collect();
    // Its own copy of the weights, so the backend may free the f32 projections it no longer reads.
    let f32_bytes = m.weights.bytes();
    let mut cpu = CpuBackend::new(m.config.clone(), Arc::new((*m.weights).clone()), 64, 16)
        .with_weight_format(pdserve_model::WeightFormat::Q4)
        .unwrap();
    eprintln!(
        "multi-row steps read {} weights; {} MB held (f32 alone: {} MB)",
        cpu.multi_row_format(),
        cpu.weight_bytes() >> 20,
        f32_bytes >> 20
    );
    // Only the Q4 projections and the Q8 LM head (which the tied embedding's rows come from) are
    // held: about 0.7 bytes per weight, against 4 for f32.
    assert_eq!(cpu.multi_row_format(), "q4");
    assert!(cpu.weight_bytes() * 5 < f32_bytes, "{} bytes held", cpu.weight_bytes());
    let mut kv = KvCache::new(KvConfig { num_blocks: 64, block_size: 16 }).unwrap();
    let seqs: Vec<SeqId> = (0..prompts.len() as u64).map(SeqId).collect();
    for (s, p) in seqs.iter().zip(&prompts) {
        kv.add_sequence(*s, p).unwrap();
    }
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut samplers: Vec<Sampler> =
        prompts.iter().map(|_| Sampler::new(SamplingParams::greedy(), 0)).collect();
    let mut first = true;
    while got.iter().zip(&wants).any(|(g, w)| g.len() < w.len()) {
        let mut inputs = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            let start = kv.computed_tokens(*s).unwrap();
            let n = if first { prompts[i].len() } else { 1 };
            kv.reserve(*s, n).unwrap();
            let tokens = kv.tokens(*s).unwrap()[start..start + n].to_vec();
            inputs.push((tokens, start, kv.block_table(*s).unwrap().to_vec()));
        }
        let steps: Vec<SeqStep<'_>> = inputs
            .iter()
            .map(|(t, p, b)| SeqStep { tokens: t, start_pos: *p, block_table: b, logits: 1, state: None })
            .collect();
        let logits = cpu.forward(&steps).unwrap();
        if first {
            // The prefill's logits (the multi-row products of projections and LM head) against the
            // f32 path's for each prompt alone.
            for (p, l) in prompts.iter().zip(&logits) {
                let f32_logits = Run::new(&mut backend(), p).step(p.len());
                let worst = l.iter().zip(&f32_logits).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
                eprintln!("multi-row prefill: largest |logit - f32 logit| {worst}");
                assert!(worst < QUANT_LOGIT_TOLERANCE, "multi-row logits differ from f32 by {worst}");
            }
        }
        for (i, s) in seqs.iter().enumerate() {
            kv.commit(*s, inputs[i].0.len()).unwrap();
            let tok = samplers[i].sample(&logits[i], &[], &got[i]).token;
            got[i].push(tok);
            kv.append_tokens(*s, &[tok]).unwrap();
        }
        first = false;
    }
    for ((g, w), p) in got.iter().zip(&wants).zip(fx["prompts"].as_array().unwrap()) {
        assert_eq!(&g[..w.len()], &w[..], "greedy tokens of {:?} decoded in a batch of three", p["name"]);
    }
}

/// The default model ships Q4_1 projections and a Q8_0 embedding (f16 scales and minimums): Q4 and
/// Q8 with f16 scales give those values back exactly.
#[test]
fn q4_weights_give_back_the_gguf_values() {
    use pdserve_model::quant::{Q4Weights, QuantMatrix};
    let m = model();
    let c = &m.config;
    let q4 = Q4Weights::quantize(&m.weights, c).unwrap();
    let mut worst = 0f32;
    for li in [0, c.num_layers - 1] {
        let (l, ql) = (&m.weights.layers[li], &q4.layers[li]);
        let qkv: Vec<f32> = [&l.q[..], &l.k[..], &l.v[..]].concat();
        for (mat, f32s) in [(&ql.qkv, &qkv[..]), (&ql.o, &l.o[..]), (&ql.down, &l.down[..])] {
            for r in 0..mat.rows() {
                let back = mat.dequantize_row(r);
                let want = &f32s[r * mat.cols()..(r + 1) * mat.cols()];
                worst = back.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(worst, f32::max);
            }
        }
    }
    for r in (0..c.vocab_size).step_by(97) {
        let back = q4.lm_head.dequantize_row(r);
        let want = &m.weights.lm_head()[r * c.hidden_size..(r + 1) * c.hidden_size];
        worst = back.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(worst, f32::max);
    }
    assert!(worst < 1e-6, "largest |dequantized - loaded| {worst}");
}

/// A long step (a 300-token prompt at once) gives the logits that steps of 8 rows give, bit for bit:
/// every product and attention computes a row the same way whatever the step's row count (batch
/// invariance, on the real model with its Q4 weights).
#[test]
fn long_quantized_steps_keep_the_logits_of_short_ones() {
    let fx = fixture();
    let long: Vec<u32> = ids(&fx["prompts"][2]["ids"]).iter().cycle().take(300).copied().collect();
    let mut cpu = quantized_backend(pdserve_model::WeightFormat::Q4);
    let whole = Run::new(&mut cpu, &long).step(long.len());
    let mut run = Run::new(&mut cpu, &long);
    for _ in 0..long.len() / 8 {
        run.step(8);
    }
    // (300 = 37 x 8 + 4.)
    let short = run.step(long.len() % 8);
    let diff = largest_difference(&whole, &short);
    eprintln!("{}: largest |long-step logit - short-step logit| {diff}", pdserve_model::cpu_kernels().name());
    assert_eq!(diff, 0.0, "long steps move logits by {diff} against steps of 8 rows");
}

/// A decode step over a long context (1,100 keys: three splits merged by their maxima and sums) gives
/// the logits the whole prompt's prefill gives for its last token, bit for bit.
#[test]
fn long_context_decode_splits_agree_with_prefill() {
    let m = model();
    let fx = fixture();
    let base = ids(&fx["prompts"][2]["ids"]);
    let long: Vec<u32> = base.iter().cycle().take(1100).copied().collect();
    let mut cpu = CpuBackend::new(m.config.clone(), Arc::clone(&m.weights), 160, 16);
    let whole = Run::new(&mut cpu, &long).step(long.len());
    let mut run = Run::new(&mut cpu, &long);
    run.step(long.len() - 1);
    let last = run.step(1);
    let diff = whole.iter().zip(&last).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert_eq!(diff, 0.0, "decode over 1,100 keys differs from prefill by {diff}");
}

/// `--weights bf16`: every product reads bf16 copies, the f32 ones are freed (the backend holds about
/// half the f32 model's bytes), and the fixture prompts still answer their greedy tokens.
#[test]
fn bf16_weights_keep_the_greedy_text_in_half_the_memory() {
    let m = model();
    let fx = fixture();
    let f32_bytes = m.weights.bytes();
    let mut cpu = CpuBackend::new(m.config.clone(), Arc::new((*m.weights).clone()), 64, 16)
        .with_weight_format(pdserve_model::WeightFormat::Bf16)
        .unwrap();
    let held = cpu.weight_bytes();
    eprintln!("bf16 weights: {} MB held (f32: {} MB)", held >> 20, f32_bytes >> 20);
    assert!(held < f32_bytes * 11 / 20, "{held} bytes held, f32 {f32_bytes}");
    let mut agree = 0;
    for p in fx["prompts"].as_array().unwrap() {
        let (tokens, want) = (ids(&p["ids"]), ids(&p["greedy"]));
        let mut run = Run::new(&mut cpu, &tokens);
        let logits = run.step(tokens.len());
        let got = run.greedy(logits, want.len());
        // bf16 weights round every projection: the first tokens must hold; a late near-tie may flip.
        assert_eq!(got[..8], want[..8], "greedy tokens of {:?} with bf16 weights", p["name"]);
        agree += got.iter().zip(&want).take_while(|(a, b)| a == b).count();
    }
    eprintln!("bf16 weights: {agree} leading greedy tokens agree with the f32 fixture");
}
