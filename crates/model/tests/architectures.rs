//! Each supported architecture and rope scaling, as a tiny random-weight checkpoint in the real
//! tensor layout (bf16 safetensors written by the test, seeded), against an independent numpy
//! implementation of the Hugging Face forward pass (`tests/fixtures/tiny_reference.py`): the greedy
//! tokens are identical and the prompt's last logits within tolerance. Needs `python3` with numpy.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use pdserve_kvcache::{KvCache, KvConfig, SeqId};
use pdserve_model::{Backend, CpuBackend, ModelConfig, SeqStep, Weights};
use serde_json::{json, Value};

const VOCAB: usize = 96;
const HIDDEN: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 16;
const INTER: usize = 96;
const LAYERS: usize = 2;
/// Long enough that positions pass each scaled variant's original context (32).
const PROMPT: usize = 40;
const STEPS: usize = 12;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }
}

/// A safetensors file of bf16 tensors (name, shape, values).
fn write_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape, values) in tensors {
        let start = data.len();
        for v in values {
            data.extend_from_slice(&half::bf16::from_f32(*v).to_bits().to_le_bytes());
        }
        header.insert(
            name.clone(),
            json!({"dtype": "BF16", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut h = serde_json::to_vec(&Value::Object(header)).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&data);
    std::fs::write(path, out).unwrap();
}

/// A checkpoint folder for `config` (merged over a small Llama shape) with seeded random weights;
/// biases and q/k norms where the architecture has them.
fn checkpoint(name: &str, config: Value) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pdserve-arch-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut c = json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "vocab_size": VOCAB, "tie_word_embeddings": false,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2
    });
    for (k, v) in config.as_object().unwrap() {
        c[k] = v.clone();
    }
    let model_type = c["model_type"].as_str().unwrap().to_owned();
    let biases = model_type == "qwen2" || c["attention_bias"] == json!(true);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut t = |name: String, shape: Vec<usize>, scale: f32| {
        let n = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|_| rng.next() * scale).collect();
        (name, shape, values)
    };
    let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    let mut tensors = vec![t("model.embed_tokens.weight".into(), vec![VOCAB, HIDDEN], 2.0)];
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}.");
        let mut norm = |name: &str, n: usize| {
            let (name, shape, v) = t(format!("{p}{name}"), vec![n], 0.4);
            (name, shape, v.iter().map(|x| 1.0 + x).collect::<Vec<f32>>())
        };
        tensors.push(norm("input_layernorm.weight", HIDDEN));
        tensors.push(norm("post_attention_layernorm.weight", HIDDEN));
        if model_type.starts_with("qwen3") {
            tensors.push(norm("self_attn.q_norm.weight", HEAD_DIM));
            tensors.push(norm("self_attn.k_norm.weight", HEAD_DIM));
        }
        // The FFN: dense, or a router and experts (Mixtral's names, or Qwen3-MoE's outside its
        // `mlp_only_layers`).
        let dense_only = c["mlp_only_layers"].as_array().is_some_and(|a| a.contains(&json!(l)));
        let experts = c["num_local_experts"].as_u64().or(c["num_experts"].as_u64()).unwrap_or(0) as usize;
        let mut ffn: Vec<(String, usize, usize)> = Vec::new();
        if experts == 0 || dense_only {
            for (n, rows, cols) in
                [("gate_proj", INTER, HIDDEN), ("up_proj", INTER, HIDDEN), ("down_proj", HIDDEN, INTER)]
            {
                ffn.push((format!("mlp.{n}"), rows, cols));
            }
        } else {
            let ei = c["moe_intermediate_size"].as_u64().map_or(INTER, |v| v as usize);
            let (pre, [g, u, d]) = if model_type == "mixtral" {
                ("block_sparse_moe", ["w1", "w3", "w2"])
            } else {
                ("mlp", ["gate_proj", "up_proj", "down_proj"])
            };
            ffn.push((format!("{pre}.gate"), experts, HIDDEN));
            for x in 0..experts {
                ffn.push((format!("{pre}.experts.{x}.{g}"), ei, HIDDEN));
                ffn.push((format!("{pre}.experts.{x}.{u}"), ei, HIDDEN));
                ffn.push((format!("{pre}.experts.{x}.{d}"), HIDDEN, ei));
            }
        }
        let attention = [
            ("self_attn.q_proj".to_owned(), q, HIDDEN),
            ("self_attn.k_proj".to_owned(), kv, HIDDEN),
            ("self_attn.v_proj".to_owned(), kv, HIDDEN),
            ("self_attn.o_proj".to_owned(), HIDDEN, q),
        ];
        for (name, rows, cols) in attention.into_iter().chain(ffn) {
            let name = name.as_str();
            tensors.push(t(format!("{p}{name}.weight"), vec![rows, cols], 0.5));
            if biases
                && name.starts_with("self_attn.")
                && (name != "self_attn.o_proj" || model_type != "qwen2")
            {
                tensors.push(t(format!("{p}{name}.bias"), vec![rows], 0.5));
            }
        }
    }
    tensors.push(t("model.norm.weight".into(), vec![HIDDEN], 0.0));
    tensors.last_mut().unwrap().2.fill(1.0);
    tensors.push(t("lm_head.weight".into(), vec![VOCAB, HIDDEN], 1.0));
    write_safetensors(&dir.join("model.safetensors"), &tensors);
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&c).unwrap()).unwrap();
    dir
}

fn prompt() -> Vec<u32> {
    (0..PROMPT).map(|i| (i * 37 % (VOCAB - 3) + 3) as u32).collect()
}

/// The numpy reference: the prompt's last logits and STEPS greedy tokens.
fn reference(dir: &Path) -> (Vec<f32>, Vec<u32>) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny_reference.py");
    let ids = serde_json::to_string(&prompt()).unwrap();
    let out = Command::new("python3")
        .arg(&script)
        .arg(dir)
        .arg(ids)
        .arg(STEPS.to_string())
        .output()
        .expect("python3 (with numpy) runs the reference");
    assert!(out.status.success(), "reference failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let logits = v["logits"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
    let greedy = v["greedy"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    (logits, greedy)
}

/// Ours: the checkpoint loaded as a user's folder, prefilled in two chunks, then decoded greedily.
fn ours(dir: &Path) -> (Vec<f32>, Vec<u32>) {
    let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let weights = Weights::load(dir, &config).unwrap();
    let mut cpu = CpuBackend::new(config, Arc::new(weights), 16, 8);
    let mut kv = KvCache::new(KvConfig { num_blocks: 16, block_size: 8 }).unwrap();
    let s = SeqId(1);
    let tokens = prompt();
    kv.add_sequence(s, &tokens).unwrap();
    let mut step = |kv: &mut KvCache, n: usize| {
        let start = kv.computed_tokens(s).unwrap();
        kv.reserve(s, n).unwrap();
        let table = kv.block_table(s).unwrap().to_vec();
        let toks = kv.tokens(s).unwrap()[start..start + n].to_vec();
        let out =
            cpu.forward(&[SeqStep { tokens: &toks, start_pos: start, block_table: &table, logits: true }]);
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
            json!({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": HEAD_DIM,
            "hidden_size": HIDDEN, "sliding_window": 16, "use_sliding_window": false}),
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
    ];
    let mut plain = None;
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
            (n, Some(p)) if (n.ends_with("-rope") && n != "dynamic-rope") || n == "mistral-window" => {
                assert!(max_diff(p, &want_logits) > 1e-2, "{name}: the scaling or window changed nothing")
            }
            _ => {}
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
