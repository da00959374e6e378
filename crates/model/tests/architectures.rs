//! Each supported architecture, rope scaling, sliding window and mixture of experts, as a tiny
//! random-weight checkpoint in the real tensor layout (bf16 safetensors, seeded, written by
//! `tests/fixtures/tiny_reference.py`), against that script's independent numpy implementation of the
//! Hugging Face forward pass: the greedy tokens are identical and the prompt's last logits within
//! tolerance. Needs `python3` with numpy.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use pdserve_kvcache::{KvCache, KvConfig, SeqId};
use pdserve_model::{
    Backend, CpuBackend, DraftStep, KvDtype, ModelConfig, PreparedWeights, SeqStep, WeightFormat, Weights,
};
use serde_json::{json, Value};

/// The tiny checkpoints' vocabulary (`BASE` in the script).
const VOCAB: usize = 96;
/// Long enough that positions pass each scaled variant's original context (32) and the window (12).
const PROMPT: usize = 40;
const STEPS: usize = 12;

/// Runs the reference script with `args`; its standard output.
fn script(args: &[&str]) -> Vec<u8> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny_reference.py");
    let out = Command::new(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()))
        .arg(&script)
        .args(args)
        .output()
        .expect("python3 (with numpy) runs");
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    out.stdout
}

/// A checkpoint folder written by the script: its tiny Llama shape with `config` merged over it,
/// seeded random bf16 weights in the architecture's tensor layout.
fn checkpoint(name: &str, config: Value) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pdserve-arch-{}-{name}", std::process::id()));
    script(&["write", dir.to_str().unwrap(), &config.to_string()]);
    dir
}

fn prompt() -> Vec<u32> {
    (0..PROMPT).map(|i| (i * 37 % (VOCAB - 3) + 3) as u32).collect()
}

/// The numpy reference: the prompt's last logits and STEPS greedy tokens.
fn reference(dir: &Path) -> (Vec<f32>, Vec<u32>) {
    reference_with(dir, &[])
}

/// [`reference`] with the script's extra `options`.
fn reference_with(dir: &Path, options: &[&str]) -> (Vec<f32>, Vec<u32>) {
    let ids = serde_json::to_string(&prompt()).unwrap();
    let steps = STEPS.to_string();
    let args = [&["run", dir.to_str().unwrap(), &ids, &steps][..], options].concat();
    let v: Value = serde_json::from_slice(&script(&args)).unwrap();
    let logits = v["logits"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
    let greedy = v["greedy"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    (logits, greedy)
}

/// Ours: the checkpoint loaded as a user's folder, prefilled in two chunks, then decoded greedily.
fn ours(dir: &Path) -> (Vec<f32>, Vec<u32>) {
    ours_as(dir, WeightFormat::F32)
}

/// [`ours`] with the weights in `format`, each layer converted as the server's loader converts it
/// (`Auto`: the checkpoint's own precision).
fn ours_as(dir: &Path, format: WeightFormat) -> (Vec<f32>, Vec<u32>) {
    ours_with(load_as(dir, format))
}

/// The checkpoint in `format`, as the server loads it: each layer converted as it is read.
fn load_as(dir: &Path, format: WeightFormat) -> CpuBackend {
    let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let mut prepared = None;
    let (weights, dtype) = Weights::load_each(dir, &config, &mut |dtype, layer, scales| {
        let p = match &mut prepared {
            Some(p) => p,
            None => prepared.insert(
                PreparedWeights::new(format.resolve(dtype, &config), &config)?.from_checkpoint(dtype),
            ),
        };
        p.push_and_free(layer, scales, &config)
    })
    .unwrap();
    let p = prepared.unwrap_or_else(|| {
        PreparedWeights::new(format.resolve(dtype, &config), &config).unwrap().from_checkpoint(dtype)
    });
    CpuBackend::new(config, Arc::new(weights), 16, 8).with_prepared(p).unwrap()
}

fn ours_with(mut cpu: CpuBackend) -> (Vec<f32>, Vec<u32>) {
    let mut kv = KvCache::new(KvConfig { num_blocks: 16, block_size: 8 }).unwrap();
    let s = SeqId(1);
    let tokens = prompt();
    kv.add_sequence(s, &tokens).unwrap();
    let mut step = |kv: &mut KvCache, n: usize| {
        let start = kv.computed_tokens(s).unwrap();
        kv.reserve(s, n).unwrap();
        let table = kv.block_table(s).unwrap().to_vec();
        let toks = kv.tokens(s).unwrap()[start..start + n].to_vec();
        let out = cpu.forward(&[SeqStep {
            tokens: &toks,
            start_pos: start,
            block_table: &table,
            logits: 1,
            state: None,
        }]);
        kv.commit(s, n).unwrap();
        out.unwrap().remove(0)
    };
    step(&mut kv, 7);
    let first = step(&mut kv, PROMPT - 7);
    let argmax = |l: &[f32]| l.iter().enumerate().fold(0, |b, (i, v)| if *v > l[b] { i } else { b }) as u32;
    let mut greedy = vec![argmax(&first)];
    while greedy.len() < STEPS {
        kv.append_tokens(s, &greedy[greedy.len() - 1..]).unwrap();
        let l = step(&mut kv, 1);
        greedy.push(argmax(&l));
    }
    (first, greedy)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn every_architecture_and_rope_scaling_matches_the_numpy_reference() {
    let scaled = |rope: Value| json!({"rope_scaling": rope});
    let cases = [
        ("llama", json!({})),
        (
            "llama3-rope",
            scaled(json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
        ),
        ("linear-rope", scaled(json!({"type": "linear", "factor": 4.0}))),
        (
            "yarn-rope",
            scaled(json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})),
        ),
        ("dynamic-rope", scaled(json!({"type": "dynamic", "factor": 2.0}))),
        ("mistral", json!({"architectures": ["MistralForCausalLM"], "model_type": "mistral"})),
        ("llama-bias", json!({"attention_bias": true})),
        ("qwen2", json!({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})),
        (
            "qwen3",
            json!({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 16,
            "hidden_size": 64, "sliding_window": 16, "use_sliding_window": false}),
        ),
        // A window shorter than the prompt: both the prefill (GEMM) and the decode attention paths
        // cut it.
        (
            "mistral-window",
            json!({"architectures": ["MistralForCausalLM"], "model_type": "mistral",
            "sliding_window": 12}),
        ),
        (
            "mixtral",
            json!({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_local_experts": 4, "num_experts_per_tok": 2}),
        ),
        (
            "qwen3-moe",
            json!({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": false,
            "decoder_sparse_step": 1, "mlp_only_layers": [0]}),
        ),
        // DeepSeek V3: latent attention with a query LoRA, interleaved rope, YaRN with mscale and
        // mscale_all_dim, sigmoid routing with a correction bias over groups, shared experts, a
        // dense first layer and an MTP layer's tensors the main model does not read.
        ("deepseek-v3", deepseek_v3()),
        // The same weights as DeepSeek ships them: e4m3 with a scale per 32 x 16 block (ragged at
        // the edges of the 24-row query LoRA).
        ("deepseek-v3-fp8", {
            let mut c = deepseek_v3();
            c["quantization_config"] = json!({"quant_method": "fp8", "fmt": "e4m3",
                "activation_scheme": "dynamic", "weight_block_size": [32, 16]});
            c
        }),
        // NVFP4 as ModelOpt ships it: e2m1 codes, an e4m3 scale per 16 columns and one f32 scale
        // per tensor, for a dense model and for experts (the router and head stay bf16).
        (
            "llama-nvfp4",
            json!({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4",
            "group_size": 16}}),
        ),
        (
            "qwen3-moe-nvfp4",
            json!({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": false,
            "decoder_sparse_step": 1, "mlp_only_layers": [0],
            "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}}),
        ),
        // MXFP4 experts as DeepSeek V4 ships them (e2m1 codes, a ue8m0 power of two per 32
        // columns as `weight_scale_inv`): stored as safetensors' F4 beside bf16 attention, and as
        // bytes (I8) beside FP8 blocks.
        (
            "qwen3-moe-mxfp4",
            json!({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": false,
            "decoder_sparse_step": 1, "mlp_only_layers": [0], "mxfp4_experts": "F4"}),
        ),
        ("deepseek-v3-mxfp4", {
            let mut c = deepseek_v3();
            c["quantization_config"] = json!({"quant_method": "fp8", "fmt": "e4m3",
                "activation_scheme": "dynamic", "weight_block_size": [32, 16]});
            c["mxfp4_experts"] = json!("I8");
            c
        }),
        // DeepSeek V3.2: V3 with sparse attention; its indexer keeps 12 of the prompt's 40
        // positions for the later rows.
        ("deepseek-v3.2", {
            let mut c = deepseek_v3();
            c["architectures"] = json!(["DeepseekV32ForCausalLM"]);
            c["model_type"] = json!("deepseek_v32");
            c["index_n_heads"] = json!(4);
            c["index_head_dim"] = json!(32);
            c["index_topk"] = json!(12);
            c
        }),
        // DeepSeek V2: no query LoRA, softmax routing limited to the best group by its best expert.
        (
            "deepseek-v2",
            json!({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
            "q_lora_rank": null, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
            "v_head_dim": 16, "n_routed_experts": 6, "n_shared_experts": 2, "num_experts_per_tok": 2,
            "n_group": 2, "topk_group": 1, "topk_method": "group_limited_greedy", "scoring_func": "softmax",
            "norm_topk_prob": false, "routed_scaling_factor": 1.5, "moe_intermediate_size": 16,
            "first_k_dense_replace": 0}),
        ),
    ];
    let (mut plain, mut deepseek, mut moe) = (None, None, None);
    for (name, config) in cases {
        let dir = checkpoint(name, config);
        let (want_logits, want_greedy) = reference(&dir);
        let (got_logits, got_greedy) = ours(&dir);
        let d = max_diff(&want_logits, &got_logits);
        eprintln!("{name}: largest logit difference {d}, greedy {got_greedy:?}");
        assert!(d < 2e-3, "{name}: logits differ from the reference by {d}");
        assert_eq!(got_greedy, want_greedy, "{name}: greedy tokens");
        // The scaled variants share the plain model's weights: their answers must differ from it,
        // or the test would pass with the scaling ignored.
        match (name, &plain) {
            ("llama", _) => plain = Some(want_logits),
            ("qwen3-moe", _) => moe = Some(want_logits),
            ("deepseek-v3", _) => {
                // The router's biased scores are mostly negative, so masking the excluded groups with
                // 0.0 (transformers) rather than -inf (DeepSeek's reference, which we follow) picks
                // other experts: the reference computed that way must differ, or the case would not
                // tell the two apart.
                let zero = reference_with(&dir, &["zero-mask"]).0;
                assert!(max_diff(&zero, &want_logits) > 1e-2, "the masking value changed nothing");
                deepseek = Some(want_logits);
            }
            ("deepseek-v3.2", _) => {
                // The same weights attending to every position answer otherwise: the selection
                // matters, so the case tells sparse attention from dense.
                let path = dir.join("config.json");
                let text = std::fs::read_to_string(&path).unwrap();
                let mut c: Value = serde_json::from_str(&text).unwrap();
                c["index_topk"] = json!(10_000);
                std::fs::write(&path, c.to_string()).unwrap();
                let dense = reference(&dir).0;
                std::fs::write(&path, text).unwrap();
                assert!(max_diff(&dense, &want_logits) > 1e-2, "the indexer's selection changed nothing");
            }
            ("deepseek-v3-fp8", _) => {
                let bf16 = deepseek.as_ref().unwrap();
                assert!(max_diff(bf16, &want_logits) > 1e-3, "FP8 rounding changed nothing: not FP8?");
                // Served as shipped (`--weights auto`): the e4m3 bytes and their block scales, widened
                // by the kernels to the values the f32 path computed, so the same answer; every
                // projection held in about a quarter of f32's bytes.
                assert_served_as_shipped(&dir, name, "fp8", (&got_logits, &got_greedy), 0.45);
            }
            ("qwen3-moe-mxfp4" | "deepseek-v3-mxfp4", _) => {
                let unrounded = if name.starts_with("qwen3") { moe.as_ref() } else { deepseek.as_ref() };
                assert!(max_diff(unrounded.unwrap(), &want_logits) > 1e-3, "{name}: MXFP4 changed nothing");
                // Served as shipped: the experts' 4-bit codes and powers of two, the rest exactly as
                // the f32 path reads it.
                assert_served_as_shipped(&dir, name, "fp4", (&got_logits, &got_greedy), 0.65);
            }
            (n, Some(p)) if n.ends_with("-nvfp4") => {
                if n == "llama-nvfp4" {
                    assert!(max_diff(p, &want_logits) > 1e-3, "FP4 rounding changed nothing: not FP4?");
                }
                // Served as shipped: 4-bit codes and their scales, widened by table to the values the
                // f32 path computed; every projection in about a fifth of f32's bytes.
                assert_served_as_shipped(&dir, name, "fp4", (&got_logits, &got_greedy), 0.6);
            }
            (n, Some(p)) if (n.ends_with("-rope") && n != "dynamic-rope") || n == "mistral-window" => {
                assert!(max_diff(p, &want_logits) > 1e-2, "{name}: the scaling or window changed nothing")
            }
            _ => {}
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// The checkpoint in `dir`, served under `--weights auto`, holds its projections in `format` and
/// answers what its f32 load answers (`f32`: logits and greedy tokens), in under `held_max` of the
/// f32 load's bytes.
fn assert_served_as_shipped(dir: &Path, name: &str, format: &str, f32: (&[f32], &[u32]), held_max: f64) {
    let cpu = load_as(dir, WeightFormat::Auto);
    assert_eq!(cpu.multi_row_format(), format, "{name}");
    let f32_bytes = load_as(dir, WeightFormat::F32).weight_bytes();
    let held = cpu.weight_bytes() as f64 / f32_bytes as f64;
    let (logits, greedy) = ours_with(cpu);
    let d = max_diff(f32.0, &logits);
    eprintln!("{name} held as {format}: {held:.3} of f32's bytes, logits within {d} of f32's");
    assert!(d < 1e-4, "{name} held as {format}: logits {d} from the f32 path's");
    assert_eq!(greedy, f32.1, "{name} held as {format}: greedy tokens");
    assert!(held < held_max, "{name} held as {format}: {held} of f32's bytes");
}

/// The tiny DeepSeek V3 shape (`config.json` overrides of the script's base).
fn deepseek_v3() -> Value {
    json!({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "q_lora_rank": 24,
    "kv_lora_rank": 64, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": true, "routed_scaling_factor": 2.5,
    "moe_intermediate_size": 32, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "num_nextn_predict_layers": 1, "rope_interleave": true,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32,
    "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}})
}

/// DeepSeek's multi-token prediction layer drafts as the numpy reference's (vLLM's formulation):
/// after a prompt prefilled in two chunks and after each greedy decode step, the draft pass over the
/// rows just computed gives the reference MTP layer's logits at the last one (its guess at the token
/// after the one just chosen) and two guesses chained on it, for V3 and for V3.2 (whose draft layer
/// has its own indexer). (The draft layer in every weight format:
/// `experts_and_latent_attention_run_in_every_weight_format`.)
#[test]
fn the_mtp_layer_drafts_as_the_reference_does() {
    for (name, config) in [("deepseek-v3-mtp", deepseek_v3()), ("deepseek-v3.2-mtp", deepseek_v32())] {
        let dir = checkpoint(name, config);
        let ids = serde_json::to_string(&prompt()).unwrap();
        let args = ["mtp", dir.to_str().unwrap(), &ids, &STEPS.to_string(), "3"];
        let v: Value = serde_json::from_slice(&script(&args)).unwrap();
        let floats =
            |v: &Value| v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect::<Vec<_>>();
        let want_greedy: Vec<u32> =
            v["greedy"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        let want_drafts: Vec<Vec<f32>> = v["drafts"].as_array().unwrap().iter().map(floats).collect();
        let mut cpu = load_as(&dir, WeightFormat::F32);
        assert_eq!(cpu.draft_layers(), 1, "{name}");
        let mut kv = KvCache::new(KvConfig { num_blocks: 16, block_size: 8 }).unwrap();
        let s = SeqId(1);
        let tokens = prompt();
        kv.add_sequence(s, &tokens).unwrap();
        let argmax =
            |l: &[f32]| l.iter().enumerate().fold(0, |b, (i, v)| if *v > l[b] { i } else { b }) as u32;
        let (mut greedy, mut drafts) = (Vec::new(), Vec::new());
        // Prompt chunks, then decode steps: the forward pass, then the draft pass over its rows.
        let mut chunk = 7;
        while greedy.len() < STEPS {
            let start = kv.computed_tokens(s).unwrap();
            // Room for the two chained guesses' positions too.
            kv.reserve(s, chunk + 2).unwrap();
            let table = kv.block_table(s).unwrap().to_vec();
            let toks = kv.tokens(s).unwrap()[start..start + chunk].to_vec();
            let logits = usize::from(start + chunk == kv.tokens(s).unwrap().len());
            let out = cpu
                .forward(&[SeqStep {
                    tokens: &toks,
                    start_pos: start,
                    block_table: &table,
                    logits,
                    state: None,
                }])
                .unwrap();
            kv.commit(s, chunk).unwrap();
            let mut next = kv.tokens(s).unwrap()[start + 1..].to_vec();
            if logits == 1 {
                greedy.push(argmax(&out[0]));
                next.push(greedy[greedy.len() - 1]);
                kv.append_tokens(s, &greedy[greedy.len() - 1..]).unwrap();
            }
            let table = kv.block_table(s).unwrap().to_vec();
            let d = cpu
                .draft(&[DraftStep {
                    step: 0,
                    next: &next[..chunk],
                    block_table: &table,
                    guesses: 3 * logits,
                }])
                .unwrap();
            assert_eq!(d.len(), 3 * logits, "{name}: logits only where asked");
            drafts.extend(d);
            chunk = if start == 0 { PROMPT - 7 } else { 1 };
        }
        assert_eq!(greedy, want_greedy, "{name}: the main model's tokens");
        assert_eq!(drafts.len(), want_drafts.len(), "{name}");
        for (i, (got, want)) in drafts.iter().zip(&want_drafts).enumerate() {
            let diff = max_diff(got, want);
            assert!(diff < 2e-3, "{name}: draft {i} differs by {diff}");
            assert_eq!(argmax(got), argmax(want), "{name}: draft {i}'s guess");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// The tiny DeepSeek V3 shape with every width a multiple of 32, as the quantized and bf16 formats
/// need (V3's 576-wide latent is 18 x 32).
fn deepseek_v3_wide() -> Value {
    let mut c = deepseek_v3();
    for (k, v) in [
        ("q_lora_rank", 32),
        ("kv_lora_rank", 64),
        ("qk_nope_head_dim", 32),
        ("qk_rope_head_dim", 32),
        ("v_head_dim", 32),
    ] {
        c[k] = v.into();
    }
    c
}

/// The tiny DeepSeek V3.2 shape: V3 with sparse attention keeping 12 positions.
fn deepseek_v32() -> Value {
    let mut sparse = deepseek_v3();
    for (k, v) in [
        ("model_type", json!("deepseek_v32")),
        ("index_n_heads", json!(4)),
        ("index_head_dim", json!(32)),
        ("index_topk", json!(12)),
    ] {
        sparse[k] = v;
    }
    sparse
}

/// Latent attention keeps the batch-invariance promise: a DeepSeek prompt's last logits are the
/// same bits computed in one step, in chunks, and beside another sequence's rows, with f16 KV.
#[test]
fn deepseek_rows_are_the_same_bits_whatever_the_step_holds() {
    for (name, config) in
        [("deepseek-invariance", deepseek_v3()), ("deepseek-v3.2-invariance", deepseek_v32())]
    {
        rows_are_the_same_bits(name, config);
    }
}

fn rows_are_the_same_bits(name: &str, config: Value) {
    let dir = checkpoint(name, config);
    let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let weights = Arc::new(Weights::load(&dir, &config).unwrap());
    let run = |chunks: &[usize], beside: bool| {
        let mut cpu = CpuBackend::with_kv_dtype(config.clone(), Arc::clone(&weights), 32, 8, KvDtype::F16);
        let mut kv = KvCache::new(KvConfig { num_blocks: 32, block_size: 8 }).unwrap();
        let (a, b) = (SeqId(1), SeqId(2));
        let other: Vec<u32> = (0..PROMPT).map(|i| (i * 11 % (VOCAB - 3) + 3) as u32).collect();
        kv.add_sequence(a, &prompt()).unwrap();
        kv.add_sequence(b, &other).unwrap();
        let mut last = Vec::new();
        for &n in chunks {
            let start = kv.computed_tokens(a).unwrap();
            kv.reserve(a, n).unwrap();
            let ta = kv.block_table(a).unwrap().to_vec();
            let toks = prompt()[start..start + n].to_vec();
            let mut steps =
                vec![SeqStep { tokens: &toks, start_pos: start, block_table: &ta, logits: 1, state: None }];
            let tb;
            if beside {
                kv.reserve(b, n).unwrap();
                tb = kv.block_table(b).unwrap().to_vec();
                steps.push(SeqStep {
                    tokens: &other[start..start + n],
                    start_pos: start,
                    block_table: &tb,
                    logits: 1,
                    state: None,
                });
            }
            last = cpu.forward(&steps).unwrap().remove(0);
            kv.commit(a, n).unwrap();
            if beside {
                kv.commit(b, n).unwrap();
            }
        }
        last
    };
    let whole = run(&[PROMPT], false);
    let bits = |l: &[f32]| l.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&run(&[7, PROMPT - 7], false)), bits(&whole), "{name}: in chunks");
    assert_eq!(
        bits(&run(&[PROMPT - 1, 1], true)),
        bits(&whole),
        "{name}: beside another sequence, then decoded"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Mixtures of experts and latent attention are served in every weight format (each expert and
/// each latent projection held in it, not in f32): the logits (and DeepSeek's draft layer's) stay
/// near the f32 ones, every row is the same bits in one step or in chunks, and the weights held
/// shrink as the format says.
#[test]
fn experts_and_latent_attention_run_in_every_weight_format() {
    let cases = [
        (
            "mixtral-formats",
            json!({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_local_experts": 4, "num_experts_per_tok": 2}),
        ),
        (
            "qwen3-moe-formats",
            json!({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [0]}),
        ),
        ("deepseek-v3-formats", deepseek_v3_wide()),
    ];
    use pdserve_model::quant::{Q4Matrix, Q8Matrix};
    use pdserve_model::{Fp4Matrix, Fp8Matrix};
    for (name, config) in cases {
        let dir = checkpoint(name, config);
        let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
        let weights = Weights::load(&dir, &config).unwrap();
        let run = |b: &mut CpuBackend, chunks: &[usize]| {
            let mut kv = KvCache::new(KvConfig { num_blocks: 16, block_size: 8 }).unwrap();
            kv.add_sequence(SeqId(1), &prompt()).unwrap();
            let mut last = Vec::new();
            for &n in chunks {
                let start = kv.computed_tokens(SeqId(1)).unwrap();
                kv.reserve(SeqId(1), n).unwrap();
                let table = kv.block_table(SeqId(1)).unwrap().to_vec();
                let toks = &prompt()[start..start + n];
                last = b
                    .forward(&[SeqStep {
                        tokens: toks,
                        start_pos: start,
                        block_table: &table,
                        logits: 1,
                        state: None,
                    }])
                    .unwrap()
                    .remove(0);
                kv.commit(SeqId(1), n).unwrap();
                // DeepSeek's draft layer over the chunk's rows, each reading the token after it
                // (token 5 after the prompt); its guess after the prompt joins the logits compared.
                if b.draft_layers() > 0 {
                    let mut next = prompt()[start + 1..start + n].to_vec();
                    next.push(if start + n == PROMPT { 5 } else { prompt()[start + n] });
                    let end = start + n == PROMPT;
                    let step = DraftStep {
                        step: 0,
                        next: &next,
                        block_table: &table,
                        guesses: 2 * usize::from(end),
                    };
                    last.extend(b.draft(&[step]).unwrap().into_iter().flatten());
                }
            }
            last
        };
        let f32 = CpuBackend::new(config.clone(), Arc::new(weights.clone()), 16, 8);
        let f32_bytes = f32.weight_bytes();
        let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
        for (format, error, bytes) in [
            (WeightFormat::Bf16, 0.02, 0.55),
            (WeightFormat::F16, 1e-4, 0.75),
            (WeightFormat::Fp8, 0.02, 0.45),
            (WeightFormat::Fp4, 0.02, 0.4),
            (WeightFormat::Q8, 0.02, 0.45),
            (WeightFormat::Q4, 0.02, 0.4),
        ] {
            // The f32 path on the weights the format holds (each projection quantized and widened
            // back; the LM head and embedding in Q8 where the format keeps them so): what's left is
            // the rounding of the activations, so a wrong matrix anywhere shows.
            let mut held = weights.clone();
            match format {
                WeightFormat::Fp8 => round_trip::<Fp8Matrix>(&mut held, &config, false),
                WeightFormat::Fp4 => round_trip::<Fp4Matrix>(&mut held, &config, false),
                WeightFormat::Q8 => round_trip::<Q8Matrix>(&mut held, &config, true),
                WeightFormat::Q4 => round_trip::<Q4Matrix>(&mut held, &config, true),
                _ => {}
            }
            let want = run(&mut CpuBackend::new(config.clone(), Arc::new(held), 16, 8), &[PROMPT]);
            let mut b =
                CpuBackend::with_kv_dtype(config.clone(), Arc::new(weights.clone()), 16, 8, KvDtype::F32)
                    .with_weight_format(format)
                    .unwrap_or_else(|e| panic!("{name} {format:?}: {e}"));
            assert_eq!(b.multi_row_format(), format.name(), "{name}");
            let whole = run(&mut b, &[PROMPT]);
            let chunked = run(&mut b, &[5, 16, PROMPT - 21]);
            let bits = |l: &[f32]| l.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&chunked), bits(&whole), "{name} {format:?}: chunks change the logits");
            let diff: Vec<f32> = whole.iter().zip(&want).map(|(a, b)| a - b).collect();
            let rel = norm(&diff) / norm(&want);
            let held = b.weight_bytes() as f64 / f32_bytes as f64;
            eprintln!("{name} {format:?}: relative error {rel}, holds {held:.3} of f32's bytes");
            assert!(rel < error, "{name} {format:?}: logits {rel} away from f32's");
            assert!(held < bytes, "{name} {format:?}: holds {held} of f32's bytes");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// Every projection of `w` (experts' and latent attention's included) quantized to `M` and widened
/// back, and with `q8_head` the LM head and embedding through Q8: the values a quantized backend
/// holds, as f32 weights.
fn round_trip<M: pdserve_model::quant::QuantMatrix>(w: &mut Weights, c: &ModelConfig, q8_head: bool) {
    use pdserve_model::quant::{Q8Matrix, QuantMatrix};
    fn through<Q: QuantMatrix>(m: &mut [f32], cols: usize) {
        if m.is_empty() {
            return;
        }
        let rows = m.len() / cols;
        let q = Q::quantize(m, rows, cols).expect("a width of whole groups");
        for r in 0..rows {
            m[r * cols..(r + 1) * cols].copy_from_slice(&q.dequantize_row(r));
        }
    }
    let h = c.hidden_size;
    for l in &mut w.layers {
        for m in [&mut l.q, &mut l.k, &mut l.v, &mut l.gate, &mut l.up] {
            through::<M>(m, h);
        }
        let o_in = l.o.len() / h;
        through::<M>(&mut l.o, o_in);
        through::<M>(&mut l.down, c.intermediate_size);
        if let Some(moe) = &mut l.moe {
            for e in moe.experts.iter_mut().chain(&mut moe.shared) {
                let ei = e.down.len() / h;
                through::<M>(&mut e.gate, h);
                through::<M>(&mut e.up, h);
                through::<M>(&mut e.down, ei);
            }
        }
        if let (Some(m), Some(mc)) = (&mut l.mla, &c.mla) {
            if let Some((a, _)) = &mut m.q_a {
                through::<M>(a, h);
            }
            through::<M>(&mut m.q_b, mc.q_lora_rank.unwrap_or(h));
            through::<M>(&mut m.kv_a, h);
            through::<M>(&mut m.k_up_t, mc.qk_nope_head_dim);
            through::<M>(&mut m.v_up, mc.kv_lora_rank);
        }
    }
    if q8_head {
        through::<Q8Matrix>(&mut w.embed, h);
        if let Some(head) = &mut w.lm_head {
            through::<Q8Matrix>(head, h);
        }
    }
}

/// A DeepSeek GGUF as llama.cpp's converter writes it (`deepseek2`: `kv_b_proj` split into
/// `attn_k_b`/`attn_v_b`, experts stacked, the router's bias as `exp_probs_b.bias`) imports into a
/// folder that answers what the original checkpoint answers, V3 (query LoRA, sigmoid groups, yarn)
/// and V2 (no query LoRA, softmax groups) alike.
#[test]
fn a_deepseek2_gguf_imports_to_the_same_model() {
    let mut v3 = deepseek_v3();
    // The converter keeps only mscale_all_dim; DeepSeek's configs have mscale equal to it.
    v3["rope_scaling"]["mscale"] = json!(0.8);
    let v2 = json!({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "q_lora_rank": null, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "n_routed_experts": 6, "n_shared_experts": 2, "num_experts_per_tok": 2,
        "n_group": 2, "topk_group": 1, "topk_method": "group_limited_greedy", "scoring_func": "softmax",
        "routed_scaling_factor": 1.5, "moe_intermediate_size": 16, "first_k_dense_replace": 1});
    for (name, config) in [("gguf-v3", v3), ("gguf-v2", v2)] {
        let dir = checkpoint(name, config);
        let gguf = dir.join("model.gguf");
        script(&["gguf", dir.to_str().unwrap(), gguf.to_str().unwrap()]);
        let out = dir.with_extension("imported");
        let _ = std::fs::remove_dir_all(&out);
        pdserve_import::import_gguf(&gguf, &out, &mut pdserve_import::Silent).unwrap();
        // DeepSeek V3's pre-tokenizer (its three split regexes) is written and compiles.
        let tokenizer = std::fs::read_to_string(out.join("tokenizer.json")).unwrap();
        assert!(tokenizer.contains("\\p{N}{1,3}"), "{name}: not DeepSeek's pre-tokenizer");
        pdserve_model::TextCodec::load(&out).unwrap_or_else(|e| panic!("{name}: {e}"));
        let (want_logits, want_greedy) = reference(&dir);
        let (got_logits, got_greedy) = ours(&out);
        let d = max_diff(&want_logits, &got_logits);
        assert!(d < 2e-3, "{name}: logits differ from the original's reference by {d}");
        assert_eq!(got_greedy, want_greedy, "{name}");
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::remove_dir_all(&out).unwrap();
    }
}

/// The benchmark's random DeepSeek-V3 shape (`RandomDeepSeek`), at a small size, with its MTP layer,
/// is a checkpoint the engine loads as V3 and runs to finite logits, its draft layer's too.
#[test]
fn the_random_deepseek_shape_loads_and_runs() {
    let shape = pdserve_import::RandomDeepSeek {
        hidden: 64,
        layers: 2,
        heads: 2,
        q_lora: 32,
        kv_lora: 64,
        nope: 32,
        rope: 32,
        v: 32,
        experts: 8,
        top_k: 2,
        shared: 1,
        moe_intermediate: 32,
        dense_intermediate: 64,
        dense_layers: 1,
        groups: 4,
        topk_groups: 2,
        vocab: VOCAB,
        context: 256,
        seed: 3,
        mtp: true,
        mxfp4_experts: false,
    };
    let dir = std::env::temp_dir().join(format!("pdserve-random-deepseek-{}", std::process::id()));
    shape.write(&dir).unwrap();
    let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let (mla, moe) = (config.mla.clone().unwrap(), config.moe.clone().unwrap());
    assert_eq!((mla.kv_lora_rank, moe.experts, moe.dense_layers, config.draft_layers), (64, 8, vec![0], 1));
    let (logits, _) = ours(&dir);
    assert!(logits.iter().all(|v| v.is_finite()) && logits.iter().any(|&v| v != logits[0]));
    let mut cpu = load_as(&dir, WeightFormat::F32);
    let table: Vec<_> = (0..5).map(pdserve_kvcache::BlockId).collect();
    let ids = prompt();
    cpu.forward(&[SeqStep { tokens: &ids, start_pos: 0, block_table: &table, logits: 1, state: None }])
        .unwrap();
    let next = [&ids[1..], &[7]].concat();
    let draft = cpu.draft(&[DraftStep { step: 0, next: &next, block_table: &table, guesses: 1 }]).unwrap();
    assert!(draft[0].iter().all(|v| v.is_finite()) && draft[0].iter().any(|&v| v != draft[0][0]));
    let (total, active) = pdserve_import::RandomDeepSeek::bench().parameters();
    assert!(
        (1.0e9..1.5e9).contains(&(total as f64)) && (0.2e9..0.4e9).contains(&(active as f64)),
        "{total} {active}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    // Its MXFP4 twin (`cargo xtask bench formats --formats mxfp4,...`): the experts as DeepSeek V4
    // ships them, served as shipped, the f32 path's answer; other values than the bf16 ones.
    let mx = pdserve_import::RandomDeepSeek { mxfp4_experts: true, mtp: false, ..shape };
    mx.write(&dir).unwrap();
    let f32 = ours_with(load_as(&dir, WeightFormat::F32));
    assert_served_as_shipped(&dir, "random mxfp4", "fp4", (&f32.0, &f32.1), 0.45);
    assert!(max_diff(&f32.0, &logits) > 1e-3, "MXFP4 rounding changed nothing");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// V3.2's selection over a long prompt in chunks that do not start on a task's boundary (a task of
/// rows straddling a 512-key split, a row of it seeing none of the split's keys): the same bits as
/// the prompt in one step.
#[test]
fn sparse_attention_rows_across_split_boundaries() {
    let mut c = deepseek_v3();
    for (k, v) in [
        ("model_type", json!("deepseek_v32")),
        ("index_n_heads", json!(4)),
        ("index_head_dim", json!(32)),
        ("index_topk", json!(12)),
        ("max_position_embeddings", json!(1024)),
    ] {
        c[k] = v;
    }
    let dir = checkpoint("deepseek-v3.2-splits", c);
    let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let weights = Arc::new(Weights::load(&dir, &config).unwrap());
    let tokens: Vec<u32> = (0..600).map(|i| (i * 37 % (VOCAB - 3) + 3) as u32).collect();
    let run = |chunks: &[usize]| {
        let mut cpu = CpuBackend::with_kv_dtype(config.clone(), Arc::clone(&weights), 80, 8, KvDtype::F16);
        let mut kv = KvCache::new(KvConfig { num_blocks: 80, block_size: 8 }).unwrap();
        kv.add_sequence(SeqId(1), &tokens).unwrap();
        let mut last = Vec::new();
        for &n in chunks {
            let start = kv.computed_tokens(SeqId(1)).unwrap();
            kv.reserve(SeqId(1), n).unwrap();
            let table = kv.block_table(SeqId(1)).unwrap().to_vec();
            let step = SeqStep {
                tokens: &tokens[start..start + n],
                start_pos: start,
                block_table: &table,
                logits: 1,
                state: None,
            };
            last = cpu.forward(&[step]).unwrap().remove(0);
            kv.commit(SeqId(1), n).unwrap();
        }
        last.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    };
    assert_eq!(run(&[7, 593]), run(&[600]));
    std::fs::remove_dir_all(&dir).unwrap();
}
