//! DeepSeek V2/V3 GGUFs (`general.architecture` `deepseek2`, as llama.cpp's converter writes them)
//! into a Hugging Face folder: `config.json` from the `deepseek2.*` keys, and the tensors under their
//! Hugging Face names. The converter splits `kv_b_proj` into `attn_k_b` (each head's key part,
//! transposed) and `attn_v_b`, and stacks each layer's experts into 3-D tensors; import joins the one
//! and splits the other. Rope rows are not permuted by the converter (DeepSeek's rope is interleaved
//! in the checkpoint and in llama.cpp alike), so they are written as they are.

use std::collections::HashMap;
use std::path::Path;

use serde_json::json;

use crate::gguf::{GgufFile, Value};
use crate::import::{tmp_sibling, write_f32_safetensors, write_json, write_tokenizer, Progress};
use crate::ImportError;

/// The shape of the latent attention, from the GGUF's keys.
struct Mla {
    heads: usize,
    kv_lora: usize,
    nope: usize,
    v: usize,
}

pub(crate) fn import(g: &GgufFile, out_dir: &Path, progress: &mut dyn Progress) -> Result<(), ImportError> {
    let key = |k: &str| format!("deepseek2.{k}");
    let opt = |k: &str| g.get(&key(k)).and_then(Value::as_u64).map(|v| v as usize);
    let n_layer = g.u64(&key("block_count"))? as usize;
    let hidden = g.u64(&key("embedding_length"))? as usize;
    let heads = g.u64(&key("attention.head_count"))? as usize;
    let rope = g.u64(&key("rope.dimension_count"))? as usize;
    let key_mla = g.u64(&key("attention.key_length_mla"))? as usize;
    let mla = Mla {
        heads,
        kv_lora: g.u64(&key("attention.kv_lora_rank"))? as usize,
        nope: key_mla.checked_sub(rope).ok_or_else(|| {
            ImportError::format(&g.path, format!("key_length_mla {key_mla} is shorter than the rope {rope}"))
        })?,
        v: g.u64(&key("attention.value_length_mla"))? as usize,
    };
    let tokens = g.strings("tokenizer.ggml.tokens")?;
    let vocab = opt("vocab_size").unwrap_or(tokens.len());
    let tied = g.tensor("output.weight").is_none();
    let bos = g.get("tokenizer.ggml.bos_token_id").and_then(Value::as_u64).unwrap_or(0);
    let eos = g.get("tokenizer.ggml.eos_token_id").and_then(Value::as_u64).unwrap_or(1);
    // llama.cpp's gating numbers: 1 softmax (V2), 2 sigmoid (V3; also its default-free V3 configs).
    let sigmoid = match opt("expert_gating_func") {
        Some(2) => true,
        Some(1) | None => false,
        Some(other) => {
            return Err(ImportError::Unsupported {
                field: "deepseek2.expert_gating_func".into(),
                value: format!("{other} (1 softmax and 2 sigmoid are imported)"),
            })
        }
    };
    let (groups, groups_used) =
        (opt("expert_group_count").unwrap_or(1), opt("expert_group_used_count").unwrap_or(1));
    let topk_method = match (sigmoid, groups > 1) {
        (true, _) => "noaux_tc",
        (false, true) => "group_limited_greedy",
        (false, false) => "greedy",
    };
    let rope_scaling = match g.get(&key("rope.scaling.type")).and_then(Value::as_str) {
        Some("yarn") => {
            let f = |k: &str| g.get(&key(&format!("rope.scaling.{k}"))).and_then(Value::as_f64);
            // The converter writes 0.1 x mscale_all_dim and not mscale; DeepSeek's configs have the
            // two equal (1.0 for V3, 0.707 for V2).
            let mscale = f("yarn_log_multiplier").map(|m| m / 0.1);
            json!({"type": "yarn", "factor": f("factor"), "original_max_position_embeddings":
                   g.get(&key("rope.scaling.original_context_length")).and_then(Value::as_u64),
                   "beta_fast": f("yarn_beta_fast"), "beta_slow": f("yarn_beta_slow"),
                   "mscale": mscale, "mscale_all_dim": mscale})
        }
        Some(other) => {
            return Err(ImportError::Unsupported {
                field: "deepseek2.rope.scaling.type".into(),
                value: other.into(),
            })
        }
        None => serde_json::Value::Null,
    };
    let v3 = sigmoid;
    let config = json!({
        "architectures": [if v3 { "DeepseekV3ForCausalLM" } else { "DeepseekV2ForCausalLM" }],
        "model_type": if v3 { "deepseek_v3" } else { "deepseek_v2" },
        "hidden_size": hidden,
        "intermediate_size": g.u64(&key("feed_forward_length"))?,
        "moe_intermediate_size": opt("expert_feed_forward_length"),
        "num_hidden_layers": n_layer,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "q_lora_rank": opt("attention.q_lora_rank"),
        "kv_lora_rank": mla.kv_lora,
        "qk_nope_head_dim": mla.nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": mla.v,
        "n_routed_experts": opt("expert_count"),
        "n_shared_experts": opt("expert_shared_count"),
        "num_experts_per_tok": opt("expert_used_count"),
        "n_group": groups,
        "topk_group": groups_used,
        "topk_method": topk_method,
        "scoring_func": if sigmoid { "sigmoid" } else { "softmax" },
        "norm_topk_prob": matches!(g.get(&key("expert_weights_norm")), Some(Value::Bool(true))),
        "routed_scaling_factor": g.get(&key("expert_weights_scale")).and_then(Value::as_f64).unwrap_or(1.0),
        "first_k_dense_replace": opt("leading_dense_block_count").unwrap_or(0),
        "moe_layer_freq": 1,
        "hidden_act": "silu",
        "rms_norm_eps": g.f64(&key("attention.layer_norm_rms_epsilon"))?,
        "rope_theta": g.get(&key("rope.freq_base")).and_then(Value::as_f64).unwrap_or(10_000.0),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": g.u64(&key("context_length"))?,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "attention_bias": false,
        "torch_dtype": "float32",
    });
    let tmp = tmp_sibling(out_dir)?;
    let result = (|| {
        write_json(&tmp.join("config.json"), &config)?;
        write_tokenizer(g, &tokens, &tmp)?;
        write_json(
            &tmp.join("generation_config.json"),
            &json!({ "bos_token_id": bos, "eos_token_id": eos }),
        )?;
        write_weights(g, &mla, &tmp.join("model.safetensors"), progress)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, out_dir).map_err(|e| ImportError::io(out_dir, e))
}

/// What a `deepseek2` GGUF tensor becomes.
enum Target {
    /// One Hugging Face tensor, as it is.
    One(String),
    /// Layer `l`'s experts, stacked on the first axis: `experts.{e}.{name}` each.
    Experts(usize, &'static str),
    /// Layer `l`'s key (`true`) or value half of `kv_b_proj`.
    KvB(usize, bool),
}

fn target(gguf: &str) -> Option<Target> {
    if let Some(n) = crate::import::global_name(gguf) {
        return Some(Target::One(n.to_owned()));
    }
    let (layer, part) = gguf.strip_prefix("blk.")?.split_once('.')?;
    let l: usize = layer.parse().ok()?;
    let hf = match part {
        "attn_k_b.weight" => return Some(Target::KvB(l, true)),
        "attn_v_b.weight" => return Some(Target::KvB(l, false)),
        "ffn_gate_exps.weight" => return Some(Target::Experts(l, "gate_proj")),
        "ffn_up_exps.weight" => return Some(Target::Experts(l, "up_proj")),
        "ffn_down_exps.weight" => return Some(Target::Experts(l, "down_proj")),
        "attn_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "attn_q_a.weight" => "self_attn.q_a_proj.weight",
        "attn_q_a_norm.weight" => "self_attn.q_a_layernorm.weight",
        "attn_q_b.weight" => "self_attn.q_b_proj.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_kv_a_mqa.weight" => "self_attn.kv_a_proj_with_mqa.weight",
        "attn_kv_a_norm.weight" => "self_attn.kv_a_layernorm.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_gate_inp.weight" => "mlp.gate.weight",
        "exp_probs_b.bias" => "mlp.gate.e_score_correction_bias",
        "ffn_gate_shexp.weight" => "mlp.shared_experts.gate_proj.weight",
        "ffn_up_shexp.weight" => "mlp.shared_experts.up_proj.weight",
        "ffn_down_shexp.weight" => "mlp.shared_experts.down_proj.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(Target::One(format!("model.layers.{l}.{hf}")))
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn write_weights(g: &GgufFile, m: &Mla, path: &Path, progress: &mut dyn Progress) -> Result<(), ImportError> {
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::with_capacity(g.tensors.len());
    // Each layer's key and value halves of kv_b_proj until both are read.
    let mut kv_b: HashMap<usize, [Option<Vec<f32>>; 2]> = HashMap::new();
    let total = g.tensors.len();
    for (i, t) in g.tensors.iter().enumerate() {
        progress.update(i, total, &format!("converting {}", t.name));
        let Some(target) = target(&t.name) else {
            return Err(ImportError::Unsupported { field: "GGUF tensor".into(), value: t.name.clone() });
        };
        let shape = t.shape();
        let values = g.dequantize(t);
        match target {
            Target::One(name) => tensors.push((name, shape, f32_bytes(&values))),
            Target::Experts(l, name) => {
                let [experts, rows, cols] = shape[..] else {
                    return Err(ImportError::format(
                        &g.path,
                        format!("{} has shape {shape:?}, not 3-D", t.name),
                    ));
                };
                for (e, chunk) in values.chunks_exact(rows * cols).enumerate().take(experts) {
                    tensors.push((
                        format!("model.layers.{l}.mlp.experts.{e}.{name}.weight"),
                        vec![rows, cols],
                        f32_bytes(chunk),
                    ));
                }
            }
            Target::KvB(l, key) => {
                // k_b: [heads, kv_lora, nope] (each head's key rows transposed); v_b: [heads, v, kv_lora].
                let want = if key { [m.heads, m.kv_lora, m.nope] } else { [m.heads, m.v, m.kv_lora] };
                if shape != want {
                    return Err(ImportError::format(
                        &g.path,
                        format!("{} has shape {shape:?}, expected {want:?}", t.name),
                    ));
                }
                let halves = kv_b.entry(l).or_default();
                halves[usize::from(!key)] = Some(values);
                if let [Some(k), Some(v)] = halves {
                    // kv_b_proj: per head, its nope key rows then its value rows, each kv_lora wide.
                    let (lora, nope, vd) = (m.kv_lora, m.nope, m.v);
                    let mut w = Vec::with_capacity(m.heads * (nope + vd) * lora);
                    for h in 0..m.heads {
                        let kh = &k[h * lora * nope..(h + 1) * lora * nope];
                        for i in 0..nope {
                            w.extend((0..lora).map(|c| kh[c * nope + i]));
                        }
                        w.extend_from_slice(&v[h * vd * lora..(h + 1) * vd * lora]);
                    }
                    tensors.push((
                        format!("model.layers.{l}.self_attn.kv_b_proj.weight"),
                        vec![m.heads * (nope + vd), lora],
                        f32_bytes(&w),
                    ));
                    kv_b.remove(&l);
                }
            }
        }
    }
    if let Some(l) = kv_b.keys().min() {
        return Err(ImportError::format(&g.path, format!("layer {l} has only one of attn_k_b and attn_v_b")));
    }
    progress.update(total, total, "writing model.safetensors");
    write_f32_safetensors(&tensors, path)
}
